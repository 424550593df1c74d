"""LoRA against full fine-tuning: device bytes of the training state, and the RL step time.

    python -m experiments.benchmarks.lora_cost [--model b] [--rank 16] [--steps 8] [--out DIR]

Bytes (no memory touched): the actor of workload `b` of the peer comparison (the ~100M Qwen2
shape: hidden 768, 16 layers, 12/4 heads, MLP 2048, vocab 1024, float32) is built abstractly
(`nnx.eval_shape`); `hybridjax.training.build.init_train_state` is evaluated with
`jax.eval_shape` for the full model and for the model with LoRA adapters (rank `--rank`, alpha
2·rank, all-linear); gradients are the shape of what is trained. Also reported: XLA's compiled
memory analysis of one SFT step (`hybridjax.offline.loop.train_step`, 4 rows × 192 tokens):
its temporaries include the merged weights and the weight-sized gradients that `LoRAModel`'s
merged forward forms (see `hybridjax.models.lora`).

Step time: `python -m hybridjax.train` on the quick-start config (the 3.4M warm start, GRPO,
16 prompts × 8 samples) for `--steps` steps, full and LoRA alternately in separate processes;
the medians of `timing_s/step`, `timing_s/update_actor` and `timing_s/reshard` after the first
two steps. Writes `DIR/lora_cost.json` (default `results/YYYYMMDD_HHMMSS/`).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from experiments.benchmarks.run import results_dir
from experiments.peers.workload import WORKLOADS
from hybridjax.models.config import ModelConfig
from hybridjax.models.decoder import CausalLM
from hybridjax.models.lora import LoRAConfig, LoRAModel, split_trainable
from hybridjax.offline.loop import train_step
from hybridjax.offline.sft import sft_objective
from hybridjax.training.build import init_train_state
from hybridjax.training.optim import OptimConfig

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _bytes(tree) -> int:
    return int(sum(np.prod(x.shape) * x.dtype.itemsize for x in jax.tree.leaves(tree)))


def state_bytes(model_shape: dict, rank: int) -> dict:
    """Parameter, gradient and optimizer-state bytes, and the compiled step's memory."""
    config = ModelConfig(vocab_size=1024, tie_word_embeddings=True, **model_shape)
    optim = OptimConfig(lr=1e-5, warmup_steps=0, total_steps=10)
    out = {}
    for name, lora in (("full", None), ("lora", LoRAConfig(rank, 2.0 * rank))):

        def make(lora=lora):
            base = CausalLM(config, nnx.Rngs(0))
            return base if lora is None else LoRAModel(base, lora, nnx.Rngs(1))

        graphdef, params = nnx.split(nnx.eval_shape(make))
        state = jax.eval_shape(init_train_state, params, optim)
        trainable, _ = split_trainable(params)
        batch = {
            "input_ids": jax.ShapeDtypeStruct((4, 192), jnp.int32),
            "attention_mask": jax.ShapeDtypeStruct((4, 192), jnp.int32),
            "loss_mask": jax.ShapeDtypeStruct((4, 192), jnp.float32),
        }
        names = ("loss", "lr", "grad_norm")
        compiled = train_step.lower(graphdef, optim, sft_objective, names, state, batch).compile()
        stats = compiled.memory_analysis()
        out[name] = {
            "params": _bytes(params),
            "trainable_params": _bytes(trainable),
            "grads": _bytes(trainable),
            "optimizer_state": _bytes(state.opt_state),
            "params_grads_optimizer": _bytes(params) + _bytes(trainable) + _bytes(state.opt_state),
            "step_temp_bytes": int(stats.temp_size_in_bytes),
        }
    return out


def step_times(rank: int, steps: int, rounds: int) -> dict:
    """Median stage times of the quick-start GRPO run, full vs LoRA (alternating processes)."""
    times = {"full": [], "lora": []}
    for _ in range(rounds):
        for name, r in (("full", 0), ("lora", rank)):
            with tempfile.TemporaryDirectory() as tmp:
                args = [
                    sys.executable, "-m", "hybridjax.train",
                    f"--config.trainer.total_training_steps={steps}",
                    "--config.trainer.test_freq=-1", "--config.trainer.val_before_train=False",
                    "--config.trainer.progress_bar=False", "--config.trainer.logger=('jsonl',)",
                    f"--config.trainer.default_local_dir={tmp}",
                    f"--config.actor_rollout_ref.model.lora_rank={r}",
                    f"--config.actor_rollout_ref.model.lora_alpha={2.0 * max(r, 1)}",
                ]  # fmt: skip
                env = dict(os.environ, PYTHONPATH=str(ROOT))
                subprocess.run(args, check=True, cwd=tmp, env=env, capture_output=True)
                lines = open(os.path.join(tmp, "logs", "metrics.jsonl")).read().splitlines()
                times[name] += [json.loads(line) for line in lines][2:]
    keys = ("timing_s/step", "timing_s/update_actor", "timing_s/reshard", "timing_s/gen")
    return {
        name: {k: statistics.median(r[k] for r in records) for k in keys}
        for name, records in times.items()
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="b", choices=sorted(WORKLOADS))
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    summary = {
        "model": args.model,
        "rank": args.rank,
        "bytes": state_bytes(WORKLOADS[args.model]["model"], args.rank),
        "quickstart_step_s": step_times(args.rank, args.steps, args.rounds),
    }
    out = pathlib.Path(args.out) if args.out else results_dir(ROOT / "results")
    out.mkdir(parents=True, exist_ok=True)
    (out / "lora_cost.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
