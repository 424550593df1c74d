"""Where step metrics go: console (progress bar + one compact line), JSONL, TensorBoard.

`Tracking` keeps verl's name and its `log(data, step)` call. Values arrive on the host already
(the trainer pulls a step's metrics in one `device_get`); this module only formats and writes.
"""

from __future__ import annotations

import json
import math
import os
from typing import Any

import numpy as np
import tqdm

LOGGERS = ("console", "jsonl", "tensorboard")

# The keys shown on the compact console line, with short labels.
CONSOLE_KEYS = (
    ("critic/score/mean", "score"),
    ("response_length/mean", "resp_len"),
    ("actor/pg_loss", "pg_loss"),
    ("actor/ppo_kl", "ppo_kl"),
    ("actor/entropy", "entropy"),
    ("critic/vf_loss", "vf_loss"),
    ("actor/grad_norm", "gnorm"),
    ("timing_s/step", "step_s"),
    ("perf/throughput", "tok/s/dev"),
)


def _plain(value: Any) -> float | int | str:
    if isinstance(value, str):
        return value
    value = np.asarray(value).item()
    return value if isinstance(value, int) else float(value)


def console_line(step: int, metrics: dict[str, Any]) -> str:
    """`step 3 | score 0.125 | resp_len 41.5 | ...` with the CONSOLE_KEYS that are present,
    plus any `val-core/*` value."""
    parts = [f"step {step}"]
    keys = list(CONSOLE_KEYS) + [
        (k, k.removeprefix("val-core/")) for k in metrics if "val-core" in k
    ]
    for key, label in keys:
        if key in metrics:
            parts.append(f"{label} {_plain(metrics[key]):.4g}")
    return " | ".join(parts)


class Tracking:
    """Writes each step's metrics to the configured loggers.

    Args:
      loggers: any of LOGGERS (`trainer.logger`).
      log_dir: directory of `metrics.jsonl` and the TensorBoard event files.
      total_steps: length of the progress bar.
      start_step: the step the run (re)starts from; the bar starts there.
      progress_bar: show the tqdm bar (the compact line is printed either way).
    Raises:
      ValueError: an unknown logger name (the message lists LOGGERS).
    """

    def __init__(
        self,
        loggers: tuple[str, ...],
        log_dir: str,
        total_steps: int,
        start_step: int = 0,
        progress_bar: bool = True,
    ):
        unknown = sorted(set(loggers) - set(LOGGERS))
        if unknown:
            raise ValueError(f"trainer.logger: unknown loggers {unknown}; known: {list(LOGGERS)}")
        self.loggers = tuple(loggers)
        self.log_dir = log_dir
        os.makedirs(log_dir, exist_ok=True)
        self._jsonl = None
        self._tb = None
        self._bar = None
        if "jsonl" in loggers:
            self._jsonl = open(os.path.join(log_dir, "metrics.jsonl"), "a")  # noqa: SIM115
        if "tensorboard" in loggers:
            from tensorboardX import SummaryWriter

            self._tb = SummaryWriter(os.path.join(log_dir, "tensorboard"))
        if "console" in loggers and progress_bar:
            self._bar = tqdm.tqdm(total=total_steps, initial=start_step, desc="training")

    def log(self, data: dict[str, Any], step: int) -> None:
        """Writes one step's metrics (host scalars) to every logger."""
        plain = {k: _plain(v) for k, v in data.items()}
        if self._jsonl is not None:
            record = {"step": step} | {
                k: (v if isinstance(v, str) or math.isfinite(v) else str(v))
                for k, v in plain.items()
            }
            self._jsonl.write(json.dumps(record) + "\n")
            self._jsonl.flush()
        if self._tb is not None:
            for key, value in plain.items():
                if not isinstance(value, str):
                    self._tb.add_scalar(key, value, step)
            self._tb.flush()
        if "console" in self.loggers:
            line = console_line(step, plain)
            if self._bar is not None:
                self._bar.update(step - self._bar.n)
                self._bar.write(line)
            else:
                print(line, flush=True)

    def close(self) -> None:
        for handle in (self._jsonl, self._tb, self._bar):
            if handle is not None:
                handle.close()
