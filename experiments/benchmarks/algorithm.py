"""Algorithm comparison: reward and validation accuracy against steps for GRPO, PPO and RLOO.

Each algorithm trains from the same start (same trainer config, seed, data order) for `steps`
steps; the training reward (`critic/score/mean`) is logged every step and the validation
accuracy (`val-core/<data_source>/acc/mean@1`) every `test_freq` steps and at the end. The
algorithms differ only in these trainer keys:

  grpo  algorithm.adv_estimator=grpo, no critic, rollout.n = `n`
  rloo  algorithm.adv_estimator=rloo, no critic, rollout.n = `n`
  ppo   algorithm.adv_estimator=gae with a critic, rollout.n = 1 (verl's PPO recipe)

Config keys (`algorithm`): trainer_config (default the quick-start config), workload (a peer
workload instead of trainer_config, e.g. "tiny" for smoke tests), algorithms
("grpo,ppo,rloo"), n, steps, test_freq, overrides (JSON of dotted trainer keys, applied to all).
"""

from __future__ import annotations

import json
import logging
import pathlib

log = logging.getLogger(__name__)

ALGORITHMS = {
    "grpo": {"algorithm.adv_estimator": "grpo", "critic.enable": False},
    "rloo": {"algorithm.adv_estimator": "rloo", "critic.enable": False},
    "ppo": {"algorithm.adv_estimator": "gae", "critic.enable": True},
}


def algorithm_overrides(name: str, n: int) -> dict:
    """Trainer keys that select algorithm `name` (raises ValueError listing the known ones)."""
    if name not in ALGORITHMS:
        raise ValueError(f"unknown algorithm {name!r}; known: {', '.join(ALGORITHMS)}")
    return ALGORITHMS[name] | {"actor_rollout_ref.rollout.n": 1 if name == "ppo" else n}


def whole_batch_micro_batches(trainer_cfg, devices: int) -> None:
    """Sets every micro-batch size to the whole mini-batch split over `devices` (one gradient
    step per mini-batch, no accumulation) and the critic's mini-batch to the actor's, so a
    change of rollout.n or turning the critic on stays a valid config."""
    rows = trainer_cfg.data.train_batch_size * trainer_cfg.actor_rollout_ref.rollout.n
    actor = trainer_cfg.actor_rollout_ref.actor
    mini_rows = actor.ppo_mini_batch_size * trainer_cfg.actor_rollout_ref.rollout.n
    per_device = max(1, mini_rows // devices)
    actor.ppo_micro_batch_size_per_gpu = per_device
    trainer_cfg.critic.ppo_mini_batch_size = actor.ppo_mini_batch_size
    trainer_cfg.critic.ppo_micro_batch_size_per_gpu = per_device
    trainer_cfg.actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu = max(
        1, rows // devices
    )


def _accuracy(val_metrics: dict) -> float | None:
    return next((v for k, v in val_metrics.items() if "/acc/mean@" in k), None)


def train_curve(trainer_cfg, steps: int, test_freq: int) -> list[dict]:
    """Validates, then trains `steps` steps; returns per step {step, reward, val_acc (or None),
    step_time_s, response_length}, starting with step 0 (validation only)."""
    from hybridjax.rl.trainer import RLTrainer

    trainer = RLTrainer(trainer_cfg)
    curve = []
    try:
        acc = _accuracy(trainer.validate())
        curve.append(dict(step=0, reward=None, val_acc=acc, step_time_s=None, response_length=None))
        for step in range(1, steps + 1):
            m = trainer.train_step(step)
            trainer.global_step = step
            val = {}
            if step == steps or (test_freq > 0 and step % test_freq == 0):
                val = trainer.validate()
            acc = _accuracy(val)
            curve.append(
                {
                    "step": step,
                    "reward": m.get("critic/score/mean"),
                    "val_acc": acc,
                    "step_time_s": m["timing_s/step"],
                    "response_length": m.get("response_length/mean"),
                }
            )
            log.info("%s", json.dumps(curve[-1]))
    finally:
        trainer.close()
    return curve


def run(cfg, out_dir: pathlib.Path) -> dict:
    import jax

    from experiments.benchmarks.throughput import load_trainer_config, workload_trainer_config

    curves = {}
    for name in [a for a in cfg.algorithms.split(",") if a]:
        if cfg.get("workload"):
            trainer_cfg, _ = workload_trainer_config(cfg.workload)
        else:
            trainer_cfg = load_trainer_config(cfg.trainer_config)
        trainer_cfg.update_from_flattened_dict(json.loads(cfg.overrides or "{}"))
        trainer_cfg.update_from_flattened_dict(algorithm_overrides(name, cfg.n))
        whole_batch_micro_batches(trainer_cfg, jax.device_count())
        t = trainer_cfg.trainer
        t.default_local_dir = str(out_dir / "checkpoints" / name)
        t.logger, t.progress_bar, t.resume_mode = (), False, "disable"
        t.total_training_steps = cfg.steps
        log.info("algorithm %s", name)
        curves[name] = train_curve(trainer_cfg, cfg.steps, cfg.test_freq)
    final = {
        name: {
            "final_reward": c[-1]["reward"],
            "final_val_acc": c[-1]["val_acc"],
            "initial_val_acc": c[0]["val_acc"],
            "mean_step_time_s": sum(p["step_time_s"] for p in c[1:]) / (len(c) - 1),
        }
        for name, c in curves.items()
    }
    source = cfg.get("workload") or cfg.trainer_config
    return {"trainer_config": source, "final": final, "curves": curves}


def plot(summary: dict, out_dir: pathlib.Path) -> None:
    """Training reward and validation accuracy against steps (`algorithm.png`)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_r, ax_v) = plt.subplots(1, 2, figsize=(10, 3.8))
    for name, curve in summary["curves"].items():
        trained = curve[1:]
        ax_r.plot([p["step"] for p in trained], [p["reward"] for p in trained], label=name)
        val = [p for p in curve if p["val_acc"] is not None]
        ax_v.plot([p["step"] for p in val], [p["val_acc"] for p in val], marker="o", label=name)
    ax_r.set(xlabel="step", ylabel="training reward (critic/score/mean)")
    ax_v.set(xlabel="step", ylabel="validation accuracy")
    ax_r.legend()
    fig.tight_layout()
    fig.savefig(out_dir / "algorithm.png", dpi=100)
    plt.close(fig)
