"""The workload every system in the peer comparison runs: one HF checkpoint, tokenizer and prompts.

`python experiments/peers/workload.py --name=a` writes `experiments/peers/.work/<name>/`:

  model/          Qwen2-shaped random checkpoint (`config.json`, `model.safetensors`) plus the
                  tokenizer (`tokenizer.json`, `tokenizer_config.json`), loadable by
                  `AutoModelForCausalLM` / `AutoTokenizer`, by Tunix's safetensors loader and by
                  `hybridjax.models`.
  train.parquet   the prompts in verl's schema (hybridjax's input).
  workload.json   prompts (8 GSM8K questions), their ground truths, lengths, sampling settings,
                  batch shape and the number of timed steps.

Workloads (issue 9):
  a  ~4M parameters, prompts as they come, responses up to 64 tokens (overhead-bound regime).
  b  ~100M parameters, prompts of exactly 64 tokens, responses of exactly 128 tokens
     (compute-bound regime).
  qs  the quick-start model and task (`configs/quickstart.py`; needs its shipped assets): the
      3.4M-parameter SFT warm start (4 layers, width 256), responses up to 16 tokens.
  c  the 3.4M random model of `a`, GSM8K prompts as they come, 8 samples per prompt, responses
     up to 256 tokens ending at EOS (long, ragged responses; prompts shared by 8 samples).
  tiny  a 1-layer model, 16-token prompts, 8-token responses (smoke tests only).

Runs in the project's virtualenv (hybridjax writes the checkpoint with its HF exporter;
`transformers` reads the tokenizer back). The checkpoint is a seeded random init, so every
system starts from bit-identical weights.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import shutil

ROOT = pathlib.Path(__file__).resolve().parents[2]
WORK = ROOT / "experiments" / "peers" / ".work"
GSM8K_TRAIN = ROOT / "tests" / "assets" / "gsm8k" / "train.jsonl"
PROJECT_TOKENIZER = ROOT / "hybridjax" / "assets" / "tokenizers" / "gsm8k_bpe"
QUICKSTART = ROOT / "hybridjax" / "assets" / "quickstart"
INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'
PAD, EOS = "<|endoftext|>", "<|im_end|>"

# Model shapes (HF Qwen2 config names) and workload settings shared by all systems.
SMALL_MODEL = dict(  # ~3.4M parameters with the 1,024-token tokenizer (workloads a and c)
    hidden_size=256,
    intermediate_size=688,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
)
WORKLOADS = {
    "a": dict(
        model=SMALL_MODEL,
        prompt_length=None,  # natural length; max_prompt_length is set to the longest
        response_length=64,
        fixed_response_length=False,
        steps=12,
        warmup=3,
    ),
    "b": dict(
        model=dict(
            hidden_size=768,
            intermediate_size=2048,
            num_hidden_layers=16,
            num_attention_heads=12,
            num_key_value_heads=4,
        ),
        prompt_length=64,
        response_length=128,
        fixed_response_length=True,
        steps=5,
        warmup=1,
    ),
    # The quick-start model and task (configs/quickstart.py): the shipped 3.4M SFT warm start and
    # arithmetic word problems, prompts rendered with its chat template, responses up to 16.
    "qs": dict(
        source="quickstart",
        prompt_length=None,
        response_length=16,
        fixed_response_length=False,
        steps=12,
        warmup=3,
    ),
    # Long ragged responses and large groups: a's model and prompts, n = 8, up to 256 tokens.
    "c": dict(
        model=SMALL_MODEL,
        prompt_length=None,
        response_length=256,
        fixed_response_length=False,
        n=8,
        steps=6,
        warmup=2,
    ),
    # Test-sized: a smoke test of the harness and the benchmarks, not a measurement.
    "tiny": dict(
        model=dict(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=1,
        ),
        prompt_length=16,
        response_length=8,
        fixed_response_length=True,
        steps=1,
        warmup=1,
    ),
}
COMMON = dict(
    num_prompts=8,
    n=4,  # samples per prompt (rollout.n / num_generations)
    temperature=1.0,
    top_p=1.0,
    top_k=None,
    learning_rate=1e-6,
    beta=0.0,  # no KL term, so no reference model pass in any system
    epsilon=0.2,
    seed=0,
)


def _train_tokenizer(out_dir: pathlib.Path) -> None:
    """Byte-level BPE (1,024 tokens) trained on GSM8K train text, with Qwen's special tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    texts = []
    with open(GSM8K_TRAIN) as f:
        for line in f:
            row = json.loads(line)
            texts += [row["question"], row["answer"]]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=1024,
        special_tokens=[PAD, EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(texts, trainer)
    tok.save(str(out_dir / "tokenizer.json"))


def _write_tokenizer(out_dir: pathlib.Path, copy: bool = True) -> None:
    """`tokenizer.json` (copied or trained, unless `copy` is False and it is there already)
    and a `tokenizer_config.json` whose chat template passes the text through."""
    if not copy:
        pass
    elif (PROJECT_TOKENIZER / "tokenizer.json").exists():
        shutil.copy(PROJECT_TOKENIZER / "tokenizer.json", out_dir / "tokenizer.json")
    else:
        _train_tokenizer(out_dir)
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "pad_token": PAD,
        "eos_token": EOS,
        "model_max_length": 4096,
        "padding_side": "left",
        # Renders the user's text unchanged: every system sees the same raw prompt string.
        "chat_template": "{% for m in messages %}{{ m['content'] }}{% endfor %}",
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2))


def _prompts(tokenizer, spec: dict) -> list[dict]:
    """The first `num_prompts` GSM8K questions (exactly `prompt_length` tokens when set)."""
    rows = []
    with open(GSM8K_TRAIN) as f:
        for line in f:
            row = json.loads(line)
            text = f"{row['question']} {INSTRUCTION}"
            truth = row["answer"].split("####")[-1].strip().replace(",", "")
            if spec["prompt_length"] is not None:
                ids = tokenizer.encode(text)
                if len(ids) < spec["prompt_length"]:
                    continue
                text = tokenizer.decode(ids[-spec["prompt_length"] :])
                if len(tokenizer.encode(text)) != spec["prompt_length"]:
                    continue  # BPE round trip changed the length; take another question
            rows.append({"prompt": text, "ground_truth": truth})
            if len(rows) == spec["num_prompts"]:
                return rows
    raise RuntimeError("not enough GSM8K questions of the requested length")


def _write_parquet(path: pathlib.Path, prompts: list[dict]) -> str:
    """The prompts in verl's parquet schema (for hybridjax's data loader)."""
    import pyarrow.parquet as pq

    from hybridjax.data.schema import table_from_rows

    rows = [
        {
            "data_source": "openai/gsm8k",
            "prompt": [{"role": "user", "content": p["prompt"]}],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": p["ground_truth"]},
            "extra_info": {"split": "train", "index": i},
        }
        for i, p in enumerate(prompts)
    ]
    pq.write_table(table_from_rows(rows), path)
    return str(path)


def _quickstart(model_dir: pathlib.Path, spec: dict) -> tuple[int, list[dict]]:
    """Copies the quick-start checkpoint; returns its parameter count and the first prompts of
    its training set, rendered with its chat template into plain text."""
    import pyarrow.parquet as pq

    from hybridjax.models.config import ModelConfig
    from hybridjax.models.hf_io import read_hf_config
    from hybridjax.models.tokenizer import Tokenizer

    source = QUICKSTART / "sft_model"
    for f in source.glob("*.safetensors*"):
        shutil.copy(f, model_dir / f.name)
    shutil.copy(source / "config.json", model_dir / "config.json")
    shutil.copy(source / "tokenizer.json", model_dir / "tokenizer.json")
    chat = Tokenizer.from_pretrained(source)
    rows = pq.read_table(QUICKSTART / "data" / "train.parquet").slice(0, spec["num_prompts"])
    prompts = [
        {"prompt": chat.render_chat(r["prompt"]), "ground_truth": r["reward_model"]["ground_truth"]}
        for r in rows.to_pylist()
    ]
    return ModelConfig.from_hf_dict(read_hf_config(source)).num_params(), prompts


def _write_checkpoint(model_dir: pathlib.Path, spec: dict, tokenizer) -> int:
    """A seeded random Qwen2-shaped `hybridjax` model exported with `hf_io.save_pretrained`
    (so every peer loads the project's own export); returns its parameter count."""
    from flax import nnx

    from hybridjax.models.config import ModelConfig
    from hybridjax.models.decoder import CausalLM
    from hybridjax.models.hf_io import save_pretrained

    config = ModelConfig(
        vocab_size=len(tokenizer),
        max_position_embeddings=1024,
        rope_theta=10000.0,
        rms_norm_eps=1e-6,
        attention_bias=True,  # Qwen2's q/k/v biases
        tie_word_embeddings=False,
        family="qwen2",
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        **spec["model"],
    )
    save_pretrained(CausalLM(config, nnx.Rngs(spec["seed"])), model_dir)
    return config.num_params()


def build(name: str, force: bool = False) -> pathlib.Path:
    """Writes workload `name` under `.work/<name>/` (kept if present) and returns that folder."""
    from transformers import AutoTokenizer

    out = WORK / name
    if (out / "workload.json").exists() and not force:
        return out
    spec = {**COMMON, **WORKLOADS[name], "name": name}
    model_dir = out / "model"
    model_dir.mkdir(parents=True, exist_ok=True)
    if spec.get("source") == "quickstart":
        spec["num_params"], spec["prompts"] = _quickstart(model_dir, spec)
        _write_tokenizer(model_dir, copy=False)
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
    else:
        _write_tokenizer(model_dir)
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        spec["num_params"] = _write_checkpoint(model_dir, spec, tokenizer)
        spec["prompts"] = _prompts(tokenizer, spec)
    lengths = [len(tokenizer.encode(p["prompt"])) for p in spec["prompts"]]
    spec["prompt_lengths"] = lengths
    spec["max_prompt_length"] = max(lengths)
    spec["eos_token_id"] = tokenizer.eos_token_id
    spec["pad_token_id"] = tokenizer.pad_token_id
    spec["model_dir"] = str(model_dir)
    spec["train_files"] = _write_parquet(out / "train.parquet", spec["prompts"])
    (out / "workload.json").write_text(json.dumps(spec, indent=2))
    return out


def load(name: str) -> dict:
    """The workload spec written by `build` (raises FileNotFoundError if not built yet)."""
    return json.loads((WORK / name / "workload.json").read_text())


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--name", choices=sorted(WORKLOADS), required=True)
    parser.add_argument("--force", action="store_true")
    args = parser.parse_args()
    print(build(args.name, args.force))
