"""Step `trl_grpo`: the `grpo` step's configuration in TRL's `GRPOTrainer` on the same GPU (torch,
bfloat16), for a first ratio of step times on a GPU.

Same shape and batch as `configs/gpu_check.py`: a random Qwen2.5-0.5B-shaped Qwen2 (its
`config.json`), the shipped GSM8K BPE tokenizer, 8 GSM8K prompts × 5 samples a step, 512
response tokens (`min_new_tokens` = `max_completion_length`, so every response is full, as a
random model's are in hybridjax), one update per generation, no KL term, lr 1e-6, TRL's
default activation recomputation. One warm-up step and 2 timed ones (a `TrainerCallback`
times each step; `torch.cuda.max_memory_allocated` gives the peak). The ratio divides TRL's
median step by the `grpo` step's (part1). A dry run: a tiny model, 2 prompts, 16 tokens, on CPU
in float32. Skips without torch or TRL; fails on a GPU machine where torch sees no GPU.
"""

from __future__ import annotations

import json
import statistics
import tempfile
import time

from experiments.gpu.step import ROOT, Context, Skip, main

MODEL = ROOT / "configs" / "models" / "qwen2.5-0.5b-instruct" / "config.json"
TOKENIZER = ROOT / "hybridjax" / "assets" / "tokenizers" / "gsm8k_bpe"
PROMPTS = ROOT / "tests" / "assets" / "gsm8k" / "train.jsonl"
WARMUP, TIMED = 1, 2
SIZES = {False: dict(prompts=8, n=5, tokens=512), True: dict(prompts=2, n=5, tokens=16)}
DRY_MODEL = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2)  # fmt: skip


def build_model(dry_run: bool, device: str):
    import torch
    import transformers

    shape = json.loads(MODEL.read_text()) | (DRY_MODEL if dry_run else {})
    config = transformers.Qwen2Config(**shape)
    dtype = torch.float32 if dry_run else torch.bfloat16
    torch.manual_seed(0)
    return transformers.Qwen2ForCausalLM(config).to(device=device, dtype=dtype)


def step_clock():
    """A TrainerCallback recording each optimizer step's seconds (`.seconds`)."""
    import torch
    import transformers

    class Clock(transformers.TrainerCallback):
        seconds: list[float] = []

        def on_step_begin(self, *_, **__):
            torch.cuda.synchronize() if torch.cuda.is_available() else None
            self.start = time.perf_counter()

        def on_step_end(self, *_, **__):
            torch.cuda.synchronize() if torch.cuda.is_available() else None
            self.seconds.append(time.perf_counter() - self.start)

    return Clock()


def run(ctx: Context) -> None:
    try:
        import torch
        import trl
        from datasets import Dataset
    except ImportError as err:
        raise Skip(
            f"no {err.name} here (the GPU image has torch; trl travels as a wheel)"
        ) from None
    import transformers

    if not ctx.dry_run and not torch.cuda.is_available():
        raise RuntimeError("torch sees no GPU")
    device = "cuda" if torch.cuda.is_available() and not ctx.dry_run else "cpu"
    size = SIZES[ctx.dry_run]
    tokenizer = transformers.AutoTokenizer.from_pretrained(TOKENIZER)
    lines = PROMPTS.read_text().splitlines()[: size["prompts"]]
    prompts = [json.loads(line)["question"] for line in lines]
    steps = WARMUP + TIMED
    config = trl.GRPOConfig(
        output_dir=tempfile.mkdtemp(prefix="trl_grpo_"),
        use_cpu=device == "cpu",
        bf16=device == "cuda",
        per_device_train_batch_size=size["prompts"] * size["n"],
        num_generations=size["n"],
        max_completion_length=size["tokens"],
        generation_kwargs={"min_new_tokens": size["tokens"]},
        learning_rate=1e-6,
        beta=0.0,
        num_iterations=1,
        max_steps=steps,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        dataloader_num_workers=0,
        disable_tqdm=True,
    )
    clock = step_clock()
    trainer = trl.GRPOTrainer(
        model=build_model(ctx.dry_run, device),
        reward_funcs=lambda completions, **_: [float(len(c)) / 1e3 for c in completions],
        args=config,
        train_dataset=Dataset.from_dict({"prompt": prompts * steps}),
        processing_class=tokenizer,
        callbacks=[clock],
    )
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    trainer.train()
    peak = torch.cuda.max_memory_allocated() if device == "cuda" else None
    timed = statistics.median(clock.seconds[WARMUP:])
    ours = ctx.earlier("grpo").get("summary", {}).get("step_s")
    versions = {"trl": trl.__version__, "torch": torch.__version__}
    ctx.save(step_times_s=clock.seconds, peak_bytes=peak, versions=versions)
    rows = [[i + 1, s, "warm-up" if i < WARMUP else "timed"] for i, s in enumerate(clock.seconds)]
    ctx.table(f"TRL {trl.__version__} GRPOTrainer steps on torch {device}", ["step", "s", ""], rows)
    ratio = timed / ours if ours else None
    rows = [["median timed step s", timed, ours, ratio],
            ["peak GB", peak / 1e9 if peak else None, None, None]]  # fmt: skip
    ctx.table(
        "TRL vs hybridjax (step grpo)", ["quantity", "TRL", "hybridjax", "TRL / hybridjax"], rows
    )


if __name__ == "__main__":
    main("trl_grpo", run)
