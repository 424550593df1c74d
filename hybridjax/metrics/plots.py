"""PNG curves of a run, drawn from its `metrics.jsonl` (written by `Tracking`).

    plot_run("checkpoints/hybridjax/quickstart/logs")  # → {"reward": ".../reward.png", ...}

Four figures, one point per training step: reward (`critic/score/mean`), validation accuracy
(every `val-core/*` key but the bootstrap `/std`s: `mean@N`, and with N > 1 samples per prompt
`best@N` and `maj@N`), response length (`response_length/mean`, with min and max), and the
per-stage timing (every `timing_s/<stage>` but the total `timing_s/step`, stacked). A figure
whose metrics are absent from the file is skipped. matplotlib's non-interactive Agg backend is
used, so this works on a machine without a display.
"""

from __future__ import annotations

import json
import os
from typing import Any

# Stages of the RL step in the order they run (trainer's `timing_s/<stage>` names); any other
# `timing_s/*` key is stacked after them, alphabetically.
STAGES = (
    "gen",
    "reward",
    "old_log_prob",
    "ref",
    "values",
    "adv",
    "update_critic",
    "update_actor",
    "reshard",
    "testing",
    "save_checkpoint",
)


def read_metrics(path: str) -> list[dict[str, Any]]:
    """The records of a metrics JSONL file, in file order; later records of a step (a resumed
    run) replace earlier ones."""
    by_step: dict[int, dict[str, Any]] = {}
    with open(path, encoding="utf-8") as f:
        for line in f:
            if line.strip():
                record = json.loads(line)
                by_step[record["step"]] = by_step.get(record["step"], {}) | record
    return [by_step[s] for s in sorted(by_step)]


def series(records: list[dict[str, Any]], key: str) -> tuple[list[int], list[float]]:
    """(steps, values) of the records that have a finite number under `key`."""
    steps, values = [], []
    for r in records:
        v = r.get(key)
        if isinstance(v, int | float) and v == v and abs(v) != float("inf"):
            steps.append(r["step"])
            values.append(float(v))
    return steps, values


def plot_run(log_dir: str, metrics_file: str = "metrics.jsonl") -> dict[str, str]:
    """Writes `reward.png`, `val_accuracy.png`, `response_length.png`, `timing.png` into
    `log_dir` from `log_dir/metrics_file`; returns {figure name: path} of those written.

    Raises:
      FileNotFoundError: there is no metrics file.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = read_metrics(os.path.join(log_dir, metrics_file))
    written: dict[str, str] = {}

    def save(name: str, fig) -> None:
        path = os.path.join(log_dir, f"{name}.png")
        fig.savefig(path, dpi=100, bbox_inches="tight")
        plt.close(fig)
        written[name] = path

    steps, reward = series(records, "critic/score/mean")
    if steps:
        fig, ax = plt.subplots(figsize=(6, 3.5))
        ax.plot(steps, reward, marker=".", label="mean reward (training samples)")
        ax.set(xlabel="step", ylabel="reward", title="Reward")
        ax.grid(alpha=0.3)
        save("reward", fig)

    val_keys = sorted(
        {k for r in records for k in r if k.startswith("val-core/") and not k.endswith("/std")}
    )
    if val_keys:
        fig, ax = plt.subplots(figsize=(6, 3.5))
        for key in val_keys:
            s, v = series(records, key)
            label = key.removeprefix("val-core/").removesuffix("/mean")
            ax.plot(s, v, marker="o", label=label)
        ax.set(xlabel="step", ylabel="accuracy", title="Validation accuracy", ylim=(0, 1))
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        save("val_accuracy", fig)

    steps, mean_len = series(records, "response_length/mean")
    if steps:
        fig, ax = plt.subplots(figsize=(6, 3.5))
        ax.plot(steps, mean_len, label="mean")
        for key, style in (("response_length/max", ":"), ("response_length/min", ":")):
            s, v = series(records, key)
            if s:
                ax.plot(s, v, style, label=key.rsplit("/", 1)[1])
        ax.set(xlabel="step", ylabel="tokens", title="Response length")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        save("response_length", fig)

    timed = {k.removeprefix("timing_s/") for r in records for k in r if k.startswith("timing_s/")}
    timed.discard("step")  # the total: the stack of the stages
    order = {stage: i for i, stage in enumerate(STAGES)}
    stages = sorted(timed, key=lambda s: (order.get(s, len(order)), s))
    if stages:
        steps = [r["step"] for r in records if any(f"timing_s/{s}" in r for s in stages)]
        fig, ax = plt.subplots(figsize=(6, 3.5))
        bottom = [0.0] * len(steps)
        for stage in stages:
            by_step = dict(zip(*series(records, f"timing_s/{stage}"), strict=True))
            heights = [by_step.get(s, 0.0) for s in steps]
            ax.bar(steps, heights, bottom=bottom, label=stage, width=0.8)
            bottom = [b + h for b, h in zip(bottom, heights, strict=True)]
        ax.set(xlabel="step", ylabel="seconds", title="Time per step, by stage")
        later = sorted(bottom[1:])
        if later and bottom[0] > 3 * later[len(later) // 2]:  # the first step compiles
            ax.set_ylim(0, 1.5 * later[-1])
            ax.annotate(
                f"step {steps[0]}: {bottom[0]:.1f} s (compiling)",
                (steps[0], 1.45 * later[-1]),
                fontsize=7,
                va="top",
            )
        ax.legend(fontsize=7, ncol=2)
        save("timing", fig)
    return written


def write_plots(log_dir: str) -> dict[str, str]:
    """`plot_run(log_dir)` when the run wrote a metrics file; prints where the PNGs went."""
    if not os.path.isfile(os.path.join(log_dir, "metrics.jsonl")):
        return {}
    written = plot_run(log_dir)
    if written:
        names = ", ".join(os.path.basename(p) for p in written.values())
        print(f"plots ({names}) written to {os.path.abspath(log_dir)}", flush=True)
    return written
