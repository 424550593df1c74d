"""hybridjax's GRPO trainer on a peer-comparison workload (JAX CPU, float32).

  .venv/bin/python experiments/peers/run_hybridjax.py --workload=a --out=/tmp/hybridjax_a.json

Same checkpoint, tokenizer, prompts, batch (8 prompts × 4 samples), lengths, sampling and reward
as `run_trl.py` / `run_tunix.py`: GRPO, no KL term, one optimizer update per step over the whole
batch. Writes JSON with the same fields as the peers (step wall and CPU times, prompt+response
tokens per step) plus the trainer's per-stage timings and MFU.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import tempfile
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

from workload import load  # noqa: E402


def trainer_config(spec: dict, out_dir: str, devices: int = 1):
    """The trainer ConfigDict for workload `spec` (GRPO, no critic, no reference), its batch
    split evenly over `devices` data-parallel shards."""
    from hybridjax.config.schema import base_config

    c = base_config()
    batch = spec["num_prompts"] * spec["n"]
    c.data.train_files = spec["train_files"]
    c.data.tokenizer = spec["model_dir"]
    c.data.max_prompt_length = spec["max_prompt_length"]
    c.data.max_response_length = spec["response_length"]
    c.data.train_batch_size = spec["num_prompts"]
    c.data.truncation = "left"
    c.data.seed = spec["seed"]
    c.actor_rollout_ref.model.path = spec["model_dir"]
    actor = c.actor_rollout_ref.actor
    actor.ppo_mini_batch_size = spec["num_prompts"]  # one optimizer update per step
    actor.ppo_micro_batch_size_per_gpu = batch // devices  # no gradient accumulation
    actor.clip_ratio = actor.clip_ratio_low = actor.clip_ratio_high = spec["epsilon"]
    actor.optim.lr = spec["learning_rate"]
    rollout = c.actor_rollout_ref.rollout
    rollout.n = spec["n"]
    rollout.temperature = spec["temperature"]
    rollout.top_p = spec["top_p"]
    rollout.top_k = spec["top_k"] or -1
    rollout.prompt_length = spec["max_prompt_length"]
    rollout.response_length = spec["response_length"]
    rollout.ignore_eos = spec["fixed_response_length"]
    rollout.log_prob_micro_batch_size_per_gpu = batch // devices
    c.critic.enable = False
    c.critic.ppo_mini_batch_size = spec["num_prompts"]  # validated even when disabled
    c.critic.ppo_micro_batch_size_per_gpu = batch // devices
    c.algorithm.adv_estimator = "grpo"
    c.trainer.seed = spec["seed"]
    c.trainer.logger = ()
    c.trainer.progress_bar = False
    c.trainer.default_local_dir = out_dir
    c.trainer.resume_mode = "disable"
    c.trainer.total_training_steps = spec["steps"] + spec["warmup"]
    return c


def run(spec: dict, steps: int) -> dict:
    """Runs `warmup + steps` trainer steps; returns the per-step measurements."""
    import jax

    from hybridjax.rl.trainer import RLTrainer

    cfg = trainer_config(spec, tempfile.mkdtemp(prefix="hybridjax_peers_"), jax.device_count())
    cfg.trainer.total_training_steps = spec["warmup"] + steps
    trainer = RLTrainer(cfg)
    walls, cpus, metrics = [], [], []
    try:
        for step in range(1, spec["warmup"] + steps + 1):
            wall, cpu = time.perf_counter(), time.process_time()
            m = trainer.train_step(step)
            walls.append(time.perf_counter() - wall)
            cpus.append(time.process_time() - cpu)
            metrics.append(m)
    finally:
        trainer.close()
    return {
        "system": "hybridjax",
        "workload": spec["name"],
        "versions": {"jax": jax.__version__, "devices": jax.device_count()},
        "warmup": spec["warmup"],
        "step_times_s": walls,
        "step_cpu_times_s": cpus,
        "tokens_per_step": [m["perf/total_num_tokens"] for m in metrics],
        "score_mean": [m.get("critic/score/mean", 0.0) for m in metrics],
        "peak_flops": trainer.peak_flops,
        "metrics": metrics,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=None, help="timed steps (after warm-up)")
    args = parser.parse_args()
    spec = load(args.workload)
    result = run(spec, args.steps or spec["steps"])
    pathlib.Path(args.out).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
