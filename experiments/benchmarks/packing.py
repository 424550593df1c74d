"""Packed sequences and shared prompts: the actor update and the full RL step, plain vs packed
vs packed + shared prompts, ratios measured in one run on one machine.

`update`: `trainer.passes.update_actor` (jitted as the trainer does: the registered GRPO loss,
gradient accumulation, one AdamW step) on one batch of `prompts × n` rows, for three stage
configs built from the same trainer config: `plain` (`model.use_remove_padding=False`),
`packed` (no padding, `actor.use_prefix_sharing=False`) and `shared` (the default). The
variants run in interleaved rounds (plain, packed, shared, plain, ...) so machine load hits
them alike; reported are medians of wall seconds per call after one warm-up call each.

Workloads (lengths in tokens; responses uniform in the range, ending at EOS):
  qs     the quick-start model (3.4M) and shape: 16 prompts × n 8, prompts as the quick-start
         data renders them (max 32), responses 3–10 of 16;
  gsm8k  the quick-start model on GSM8K: 4 prompts × n 8, the first GSM8K test questions in
         the chat template (`hybridjax.data.gsm8k`'s instruction), responses 32–256 of 256;
  b      the peer comparison's 102M model: 2 prompts × n 4, prompts 40–64 of 64, responses
         32–128 of 128.

`step`: `python -m hybridjax.train`'s quick start (`configs/quickstart.py`), `warmup + steps`
RL steps per variant in one process; medians of `timing_s/step` and `timing_s/update_actor`,
and the number of shapes each jitted device stage compiled over those steps.

    python -m experiments.benchmarks.packing [--workloads qs,gsm8k,b] [--repeats 5]
        [--step_steps 4] [--out DIR]

Writes `DIR/packing.json` (default `results/YYYYMMDD_HHMMSS/`).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import statistics
import time

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[2]
VARIANTS = {
    "plain": {"actor_rollout_ref.model.use_remove_padding": False},
    "packed": {"actor_rollout_ref.actor.use_prefix_sharing": False},
    "shared": {},
}
QS_MODEL = ROOT / "hybridjax" / "assets" / "quickstart" / "sft_model"
WORKLOADS = {
    "qs": dict(prompts=16, n=8, prompt=(20, 32), response=(3, 10), P=32, R=16, model="qs"),
    "gsm8k": dict(prompts=4, n=8, prompt="gsm8k", response=(32, 256), P=0, R=256, model="qs"),
    "b": dict(prompts=2, n=4, prompt=(40, 64), response=(32, 128), P=64, R=128, model="b"),
}


def _gsm8k_prompts(count: int) -> list[list[int]]:
    from hybridjax.data.gsm8k import INSTRUCTION
    from hybridjax.models.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_pretrained(str(QS_MODEL))
    with open(ROOT / "tests" / "assets" / "gsm8k" / "test.jsonl") as f:
        questions = [json.loads(line)["question"] for line, _ in zip(f, range(count), strict=False)]
    texts = [
        tokenizer.render_chat([{"role": "user", "content": f"{q} {INSTRUCTION}"}])
        for q in questions
    ]
    return tokenizer.encode_batch(texts)


def make_batch(spec: dict, vocab: int, seed: int = 0):
    """An `RLBatch` of prompts × n rows (contiguous groups) with GRPO-like advantages."""
    import jax.numpy as jnp

    from hybridjax.training.batch import make_batch as assemble

    rng = np.random.default_rng(seed)
    if spec["prompt"] == "gsm8k":
        prompts = _gsm8k_prompts(spec["prompts"])
        spec = dict(spec, P=max(map(len, prompts)))
    else:
        lo, hi = spec["prompt"]
        prompts = [
            list(rng.integers(3, vocab, rng.integers(lo, hi + 1))) for _ in range(spec["prompts"])
        ]
    b, p_cols, r_cols = spec["prompts"] * spec["n"], spec["P"], spec["R"]
    prompt_ids, prompt_mask = np.zeros((b, p_cols), np.int32), np.zeros((b, p_cols), np.int32)
    for i, tokens in enumerate(prompts):
        rows = slice(i * spec["n"], (i + 1) * spec["n"])
        prompt_ids[rows, p_cols - len(tokens) :] = tokens
        prompt_mask[rows, p_cols - len(tokens) :] = 1
    lengths = rng.integers(spec["response"][0], spec["response"][1] + 1, b)
    response_mask = (np.arange(r_cols)[None] < lengths[:, None]).astype(np.float32)
    responses = rng.integers(3, vocab, (b, r_cols)) * response_mask.astype(np.int32)
    batch = assemble(*map(jnp.asarray, (prompt_ids, prompt_mask, responses, response_mask)))
    adv = rng.normal(size=(b, 1)).astype(np.float32) * response_mask
    batch = batch.replace(advantages=jnp.asarray(adv))
    tokens = dict(padded=int(b * (p_cols + r_cols)), valid=int(prompt_mask.sum() + lengths.sum()),
                  unique=int(sum(map(len, prompts)) + lengths.sum()))  # fmt: skip
    return batch, spec, tokens


def _model(name: str):
    from flax import nnx

    from experiments.peers.workload import WORKLOADS as PEERS
    from hybridjax.models.config import ModelConfig
    from hybridjax.models.decoder import CausalLM
    from hybridjax.models.hf_io import load_pretrained

    if name == "qs":
        model = load_pretrained(str(QS_MODEL))
    else:
        config = ModelConfig(vocab_size=1024, attention_bias=True, **PEERS[name]["model"])
        model = CausalLM(config, nnx.Rngs(0))
    return (*nnx.split(model), model.config)


def _stage_config(spec: dict, variant: str, model_config):
    from hybridjax.config.schema import base_config
    from hybridjax.training import build

    c = base_config()
    rows = spec["prompts"] * spec["n"]
    c.data.train_batch_size = spec["prompts"]
    c.data.max_prompt_length = c.actor_rollout_ref.rollout.prompt_length = spec["P"]
    c.data.max_response_length = c.actor_rollout_ref.rollout.response_length = spec["R"]
    c.actor_rollout_ref.rollout.n = spec["n"]
    c.actor_rollout_ref.actor.ppo_mini_batch_size = spec["prompts"]
    c.actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu = rows  # one micro-batch, as qs
    c.algorithm.adv_estimator = "grpo"
    c.update_from_flattened_dict(VARIANTS[variant])
    return build.stage_config(c, total_steps=10, data_parallel=1, actor=model_config)


def measure_update(name: str, repeats: int) -> dict:
    import jax

    from hybridjax.training import build, passes

    spec = WORKLOADS[name]
    graphdef, params, model_config = _model(spec["model"])
    vocab = params["model"]["embed_tokens"][...].shape[0]
    batch, spec, tokens = make_batch(spec, vocab)
    update = jax.jit(passes.update_actor, static_argnums=(0, 4))
    runs, cfgs = (
        {v: [] for v in VARIANTS},
        {v: _stage_config(spec, v, model_config) for v in VARIANTS},
    )
    states = {v: build.init_train_state(params, cfgs[v].actor_optim) for v in VARIANTS}
    first = {}
    for variant in VARIANTS:  # warm-up: compile + one call
        tic = time.perf_counter()
        jax.block_until_ready(
            update(graphdef, states[variant], batch, jax.random.key(0), cfgs[variant])
        )
        first[variant] = time.perf_counter() - tic
    for _ in range(repeats):
        for variant in VARIANTS:
            tic = time.perf_counter()
            out = update(graphdef, states[variant], batch, jax.random.key(0), cfgs[variant])
            jax.block_until_ready(out)
            runs[variant].append(time.perf_counter() - tic)
    med = {v: statistics.median(runs[v]) for v in VARIANTS}
    packing = {v: cfgs[v].actor_update.packing for v in VARIANTS}
    result = dict(
        workload=name,
        rows=int(batch.batch_size),
        prompt_columns=spec["P"],
        response_columns=spec["R"],
        tokens=tokens,
        packing={v: (p.__dict__ if p else None) for v, p in packing.items()},
        first_call_s=first,
        wall_s=med,
        wall_s_all=runs,
        speedup_packed=med["plain"] / med["packed"],
        speedup_shared=med["plain"] / med["shared"],
    )
    print(f"update {name}: " + ", ".join(f"{v} {med[v]:.3f} s" for v in VARIANTS)
          + f"  packed {result['speedup_packed']:.2f}×  shared {result['speedup_shared']:.2f}×",
          flush=True)  # fmt: skip
    return result


def measure_step(steps: int, warmup: int) -> dict:
    """Quick-start RL steps per variant (fresh trainer each), medians of the timed steps."""
    import tempfile

    from experiments.benchmarks.throughput import load_trainer_config
    from hybridjax.rl import RLTrainer
    from hybridjax.rl import step as step_module

    jitted = {k: v for k, v in vars(step_module).items() if hasattr(v, "_cache_size")}
    out = {}
    for variant, changes in VARIANTS.items():
        before = {k: f._cache_size() for k, f in jitted.items()}
        cfg = load_trainer_config(str(ROOT / "configs" / "quickstart.py"))
        cfg.trainer.default_local_dir = tempfile.mkdtemp(prefix="hybridjax_packing_")
        cfg.trainer.logger = ()
        cfg.trainer.progress_bar = False
        cfg.trainer.test_freq = -1
        cfg.trainer.val_before_train = False
        cfg.update_from_flattened_dict(changes)
        trainer = RLTrainer(cfg)
        metrics = [trainer.train_step(s) for s in range(1, warmup + steps + 1)]
        trainer.close()
        timed = metrics[warmup:]
        med = lambda key: statistics.median(m.get(key, 0.0) for m in timed)
        out[variant] = {
            k: med(k) for k in ("timing_s/step", "timing_s/update_actor", "timing_s/gen")
        }
        out[variant]["update_actor_share"] = med("timing_s/update_actor") / med("timing_s/step")
        # compiled shapes of the device stages over these steps (one per stage = static shapes)
        out[variant]["stage_compiles"] = {
            k: f._cache_size() - before[k] for k, f in jitted.items() if f._cache_size() > before[k]
        }
        print(f"step {variant}: {json.dumps(out[variant])}", flush=True)
    for v in ("packed", "shared"):
        out[f"speedup_step_{v}"] = out["plain"]["timing_s/step"] / out[v]["timing_s/step"]
        out[f"speedup_update_{v}"] = (
            out["plain"]["timing_s/update_actor"] / out[v]["timing_s/update_actor"]
        )
    return out


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workloads", default="qs,gsm8k,b")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--step_steps", type=int, default=4, help="0: skip the full step")
    parser.add_argument("--step_warmup", type=int, default=2)
    parser.add_argument("--out", default="")
    args = parser.parse_args(argv)
    stamp = datetime.datetime.now(datetime.UTC).strftime("%Y%m%d_%H%M%S")
    out_dir = pathlib.Path(args.out or ROOT / "results" / stamp)
    out_dir.mkdir(parents=True, exist_ok=True)
    summary = dict(benchmark="packing", load_average_start=os.getloadavg(), repeats=args.repeats)
    summary["update"] = [measure_update(w, args.repeats) for w in args.workloads.split(",") if w]
    if args.step_steps:
        summary["step_quickstart"] = measure_step(args.step_steps, args.step_warmup)
    summary["load_average_end"] = os.getloadavg()
    path = out_dir / "packing.json"
    path.write_text(json.dumps(summary, indent=2))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
