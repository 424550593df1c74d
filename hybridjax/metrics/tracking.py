"""Where step metrics go: console (progress bar + one compact line), JSONL, TensorBoard, wandb.

`Tracking` keeps verl's name and its `log(data, step)` call. Values arrive on the host already
(the trainer pulls a step's metrics in one `device_get`); this module only formats and writes.
Besides scalars, `data` may hold generation samples under keys ending in `/generations`
(`val/generations`, `train/generations`: lists of (prompt, response, score)); they go to
`generations.jsonl`, TensorBoard text and a wandb table (verl's `val/generations`), never to
the console.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
from typing import Any

import numpy as np
import tqdm

LOGGERS = ("console", "jsonl", "tensorboard", "wandb")
# logger -> (module it needs, how to install it); the others come with hybridjax itself
OPTIONAL_LOGGERS = {"wandb": ("wandb", "pip install -e '.[wandb]'  (or: pip install wandb)")}

# The keys shown on the compact console line, with short labels.
CONSOLE_KEYS = (
    ("critic/score/mean", "score"),
    ("response_length/mean", "resp_len"),
    ("actor/pg_loss", "pg_loss"),
    ("actor/ppo_kl", "ppo_kl"),
    ("actor/entropy", "entropy"),
    ("critic/vf_loss", "vf_loss"),
    ("actor/grad_norm", "gnorm"),
    ("train/loss", "loss"),  # SFT
    ("val/loss", "val_loss"),
    ("loss", "loss"),  # DPO (TRL's names)
    ("rewards/accuracies", "acc"),
    ("rewards/margins", "margin"),
    ("eval_loss", "eval_loss"),
    ("eval_rewards/accuracies", "eval_acc"),
    ("timing_s/step", "step_s"),
    ("perf/throughput", "tok/s/dev"),
)


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a module set to None in sys.modules, a broken package
        return False


def missing_logger_packages(loggers) -> list[str]:
    """One message per requested logger whose package is not installed, with its install
    command (empty when all are there)."""
    return [
        f"trainer.logger includes {name!r} but the {module!r} package is not installed; "
        f"install it with: {command}"
        for name, (module, command) in OPTIONAL_LOGGERS.items()
        if name in loggers and not _installed(module)
    ]


def _plain(value: Any) -> float | int | str:
    if isinstance(value, str):
        return value
    value = np.asarray(value).item()
    return value if isinstance(value, int) else float(value)


def _is_generations(key: str) -> bool:
    return key.endswith("/generations")


def console_line(step: int, metrics: dict[str, Any]) -> str:
    """`step 3 | score 0.125 | resp_len 41.5 | ...` with the CONSOLE_KEYS that are present,
    plus the `val-core/*` values (their bootstrap `/std` left out)."""
    parts = [f"step {step}"]
    keys = list(CONSOLE_KEYS) + [
        (k, k.removeprefix("val-core/"))
        for k in metrics
        if k.startswith("val-core/") and not k.endswith("/std")
    ]
    for key, label in keys:
        if key in metrics:
            parts.append(f"{label} {_plain(metrics[key]):.4g}")
    return " | ".join(parts)


def generations_markdown(samples: list[tuple[str, str, float]], step: int) -> str:
    """verl's TensorBoard text for generation samples."""
    text = f"**Generation Results - Step {step}**\n\n"
    for i, (prompt, response, score) in enumerate(samples):
        text += f"### Sample {i + 1}\n**Input:** {prompt}\n\n**Output:** {response}\n\n"
        text += f"**Score:** {score}\n\n---\n\n"
    return text


class Tracking:
    """Writes each step's metrics to the configured loggers.

    Args:
      loggers: any of LOGGERS (`trainer.logger`).
      log_dir: directory of `metrics.jsonl`, `generations.jsonl`, the TensorBoard event files
        (`tensorboard/<experiment_name>/`) and the wandb run (`wandb/`).
      total_steps: length of the progress bar.
      start_step: the step the run (re)starts from; the bar starts there.
      progress_bar: show the tqdm bar (the compact line is printed either way).
      run_name: (`trainer.project_name`, `trainer.experiment_name`): the wandb project and run
        name, the TensorBoard run directory.
      config: the run's config as a plain dict, stored with the wandb run and as TensorBoard
        text.
    Raises:
      ValueError: an unknown logger name (the message lists LOGGERS).
      ImportError: a requested optional logger is not installed (the message says how).

    wandb honours its own environment (`WANDB_MODE=offline` runs with no network and keeps the
    run under `log_dir/wandb/`, to `wandb sync` later; `WANDB_API_KEY`, `WANDB_ENTITY`). A
    resumed run continues the same wandb run (its id is kept in `log_dir/wandb/run_id`).
    """

    def __init__(
        self,
        loggers: tuple[str, ...],
        log_dir: str,
        total_steps: int,
        start_step: int = 0,
        progress_bar: bool = True,
        run_name: tuple[str, str] = ("hybridjax", "run"),
        config: dict[str, Any] | None = None,
    ):
        unknown = sorted(set(loggers) - set(LOGGERS))
        if unknown:
            raise ValueError(f"trainer.logger: unknown loggers {unknown}; known: {list(LOGGERS)}")
        missing = missing_logger_packages(loggers)
        if missing:
            raise ImportError("; ".join(missing))
        self.loggers = tuple(loggers)
        self.log_dir = log_dir
        self.project_name, self.experiment_name = run_name
        os.makedirs(log_dir, exist_ok=True)
        self._jsonl = self._tb = self._bar = self.wandb_run = None
        self._generations: Any = None  # generations.jsonl, opened at the first samples
        self._wandb_tables: dict[str, Any] = {}
        if "jsonl" in loggers:
            self._jsonl = open(os.path.join(log_dir, "metrics.jsonl"), "a")  # noqa: SIM115
        if "tensorboard" in loggers:
            from tensorboardX import SummaryWriter

            self._tb = SummaryWriter(os.path.join(log_dir, "tensorboard", self.experiment_name))
            self._tb.add_text("run", f"{self.project_name} / {self.experiment_name}", start_step)
            if config is not None:
                text = json.dumps(config, indent=2, default=str)
                self._tb.add_text("config", f"```\n{text}\n```", start_step)
        if "wandb" in loggers:
            self.wandb_run = self._init_wandb(config)
        if "console" in loggers and progress_bar:
            self._bar = tqdm.tqdm(total=total_steps, initial=start_step, desc="training")

    def _init_wandb(self, config: dict[str, Any] | None):
        import wandb

        directory = os.path.join(self.log_dir, "wandb")
        os.makedirs(directory, exist_ok=True)
        id_file = os.path.join(directory, "run_id")
        run_id = None
        if os.path.isfile(id_file):
            with open(id_file) as f:
                run_id = f.read().strip() or None
        run = wandb.init(
            project=self.project_name,
            name=self.experiment_name,
            id=run_id,
            resume="allow",
            dir=self.log_dir,
            config=config,
            settings=wandb.Settings(quiet=True),
        )
        with open(id_file, "w") as f:
            f.write(run.id)
        return run

    def log(self, data: dict[str, Any], step: int) -> None:
        """Writes one step's metrics (host scalars, and `*/generations` samples) to every
        logger."""
        generations = {k: v for k, v in data.items() if _is_generations(k)}
        plain = {k: _plain(v) for k, v in data.items() if not _is_generations(k)}
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
        if self.wandb_run is not None:
            self.wandb_run.log(plain, step=step)
        for key, samples in generations.items():
            self.log_generations(key, samples, step)
        if "console" in self.loggers:
            line = console_line(step, plain)
            if self._bar is not None:
                self._bar.update(step - self._bar.n)
                self._bar.write(line)
            else:
                print(line, flush=True)

    def log_generations(self, key: str, samples: list[tuple[str, str, float]], step: int):
        """(prompt, response, score) samples under `key` (e.g. `val/generations`): one JSON line
        each in `generations.jsonl`, one TensorBoard text, one row of a wandb table (verl's
        layout: step, input_1, output_1, score_1, ...)."""
        if not samples:
            return
        if "jsonl" in self.loggers:
            if self._generations is None:
                path = os.path.join(self.log_dir, "generations.jsonl")
                self._generations = open(path, "a")  # noqa: SIM115
            for prompt, response, score in samples:
                record = {"step": step, "key": key, "prompt": prompt, "response": response}
                self._generations.write(json.dumps(record | {"score": float(score)}) + "\n")
            self._generations.flush()
        if self._tb is not None:
            self._tb.add_text(key, generations_markdown(samples, step), step)
            self._tb.flush()
        if self.wandb_run is not None:
            import wandb

            columns = ["step"] + [
                f"{name}_{i + 1}"
                for i in range(len(samples))
                for name in ("input", "output", "score")
            ]
            previous = self._wandb_tables.get(key)
            rows = previous.data if previous is not None and previous.columns == columns else []
            table = wandb.Table(columns=columns, data=rows)  # type: ignore[arg-type]  # a new table per log (wandb#2981)
            table.add_data(step, *[x for sample in samples for x in sample])
            self.wandb_run.log({key: table}, step=step)
            self._wandb_tables[key] = table

    def close(self) -> None:
        for handle in (self._jsonl, self._generations, self._tb, self._bar):
            if handle is not None:
                handle.close()
        if self.wandb_run is not None:
            self.wandb_run.finish()
