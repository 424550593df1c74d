"""`python -m hybridjax.dpo --config=configs/dpo_arithmetic.py [--config.a.b=value ...]`

Preference training on (prompt, chosen, rejected) rows, TRL's `DPOTrainer` schema: parquet or
jsonl with `prompt` (a string, or a list of `{role, content}` messages rendered with the chat
template) and `chosen` / `rejected` (strings, or message lists whose assistant turn is taken).
Each side is tokenized as an SFT pair (`hybridjax.sft.tokenize_pairs`: chat-templated prompt,
response, EOS); a sequence's log-probability is the sum over its response tokens and EOS.

Losses (`dpo.loss_type`), with Δ = (log π(y_c) − log π_ref(y_c)) − (log π(y_r) − log π_ref(y_r)):
  * `sigmoid`: DPO (Rafailov et al. 2023, eq. 7), −log σ(βΔ); with `dpo.label_smoothing` ε
    the conservative cDPO (Mitchell 2023): −(1−ε) log σ(βΔ) − ε log σ(−βΔ);
  * `ipo`: IPO (Azar et al. 2023, eq. 17), (Δ̄ − 1/(2β))², Δ̄ the log-ratios divided by each
    side's response length, as TRL computes it;
  * `hinge`: SLiC's hinge (Zhao et al. 2023), max(0, 1 − βΔ).
The reference policy is the model as loaded: its log-probs are computed once at start (before
any resume) and kept with the rows, so there is no second copy of the weights; with LoRA
(`model.lora_rank` > 0) it is the base with the adapters off.

Metrics are TRL's: `loss`, `learning_rate`, `grad_norm`, `rewards/chosen` (β·(log π − log
π_ref) of y_c), `rewards/rejected`, `rewards/accuracies` (share with chosen > rejected),
`rewards/margins`, `logps/chosen`, `logps/rejected`, and on the validation files the same with
an `eval_` prefix, plus `eval_logps/accuracies` (the share of held-out pairs where the policy
itself gives y_c more probability than y_r; `trainer.val_before_train` logs it for the start).
Optimizer, schedule, checkpoints with resume, HF export (LoRA: merged, plus a peft adapter) are
those of `hybridjax.sft` (`hybridjax.offline.loop`).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from ml_collections import ConfigDict

from hybridjax.errors import ConfigError, UserError, cli_errors
from hybridjax.models.logprobs import FUSED, LogProbConfig, next_token_log_probs
from hybridjax.models.lora import adapters_off
from hybridjax.models.tokenizer import Tokenizer
from hybridjax.offline import loop
from hybridjax.offline.sft import (
    batch_indices,
    build_model,
    check_keys,
    read_rows,
    sft_config,
    tokenize_pairs,
    training_head,
)

if TYPE_CHECKING:
    from absl import flags

log = logging.getLogger(__name__)
# the command line's flags, defined by `cli` (absl parses them before `main` runs)
_CONFIG: flags.FlagHolder[ConfigDict]
_OVERWRITE: flags.FlagHolder[bool]

LOSS_TYPES = ("sigmoid", "ipo", "hinge")
TRL_METRIC_NAMES = ("loss", "learning_rate", "grad_norm")


def dpo_config() -> ConfigDict:
    """Every DPO key with its default: `hybridjax.sft`'s model/optim/trainer/mesh keys (TRL's
    DPO learning rate and `beta`), the preference columns, and `dpo.*`."""
    c = sft_config()
    c.data = dict(
        train_files="",
        val_files="",
        tokenizer="",
        prompt_key="prompt",
        chosen_key="chosen",
        rejected_key="rejected",
        max_length=128,  # prompt + response + EOS tokens, per side
        truncation="error",  # error | right
        train_batch_size=32,  # pairs
    )
    c.dpo = dict(beta=0.1, loss_type="sigmoid", label_smoothing=0.0)
    c.optim.lr = 1e-6
    c.optim.lr_warmup_steps_ratio = 0.0
    c.optim.warmup_style = "constant"
    c.trainer.experiment_name = "dpo"  # default_local_dir: checkpoints/hybridjax/dpo
    return c


@dataclasses.dataclass(frozen=True)
class DPOConfig:
    """`dpo.*`, checked."""

    beta: float = 0.1
    loss_type: str = "sigmoid"
    label_smoothing: float = 0.0

    def __post_init__(self):
        problems = []
        if self.loss_type not in LOSS_TYPES:
            problems.append(f"dpo.loss_type {self.loss_type!r}: use one of {list(LOSS_TYPES)}")
        if self.beta <= 0:
            problems.append(f"dpo.beta must be > 0, got {self.beta}")
        if not 0 <= self.label_smoothing < 0.5:
            problems.append(f"dpo.label_smoothing must be in [0, 0.5), got {self.label_smoothing}")
        if self.label_smoothing and self.loss_type != "sigmoid":
            problems.append("dpo.label_smoothing (cDPO) applies to loss_type 'sigmoid' only")
        if problems:
            raise ValueError("; ".join(problems))


# ---------------------------------------------------------------------------------- loss


def pair_losses(
    chosen_logps: jax.Array,
    rejected_logps: jax.Array,
    ref_chosen_logps: jax.Array,
    ref_rejected_logps: jax.Array,
    chosen_lengths: jax.Array,
    rejected_lengths: jax.Array,
    config: DPOConfig,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Per-pair loss and the implicit rewards β·(log π − log π_ref) of both sides.

    Args: sequence log-probs (sums over response tokens, nats), each B float32; response lengths
      B (tokens, for IPO). Returns (loss B, chosen rewards B, rejected rewards B), float32.
    """
    chosen_ratio = chosen_logps - ref_chosen_logps
    rejected_ratio = rejected_logps - ref_rejected_logps
    delta = chosen_ratio - rejected_ratio
    beta, eps = config.beta, config.label_smoothing
    if config.loss_type == "sigmoid":
        loss = -(1 - eps) * jax.nn.log_sigmoid(beta * delta) - eps * jax.nn.log_sigmoid(
            -beta * delta
        )
    elif config.loss_type == "ipo":
        per_token = chosen_ratio / jnp.maximum(chosen_lengths, 1.0)
        per_token -= rejected_ratio / jnp.maximum(rejected_lengths, 1.0)
        loss = (per_token - 1 / (2 * beta)) ** 2
    else:  # hinge
        loss = jax.nn.relu(1 - beta * delta)
    return loss, beta * chosen_ratio, beta * rejected_ratio


def dpo_metrics(loss, chosen_rewards, rejected_rewards, chosen_logps, rejected_logps, prefix=""):
    """TRL's names, each a mean over the pairs given (rows of the B arrays)."""
    return {
        f"{prefix}loss": loss.mean(),
        f"{prefix}rewards/chosen": chosen_rewards.mean(),
        f"{prefix}rewards/rejected": rejected_rewards.mean(),
        f"{prefix}rewards/accuracies": (chosen_rewards > rejected_rewards).mean(dtype=jnp.float32),
        f"{prefix}rewards/margins": (chosen_rewards - rejected_rewards).mean(),
        f"{prefix}logps/chosen": chosen_logps.mean(),
        f"{prefix}logps/rejected": rejected_logps.mean(),
    }


def sequence_log_probs(
    graphdef, params, batch: dict[str, jax.Array], head: LogProbConfig = FUSED
) -> tuple[jax.Array, jax.Array]:
    """(Σ log π over each row's response tokens and EOS, their count), each N float32, for rows
    laid out as `tokenize_pairs` writes them; `head` as `models.logprobs`."""
    model = nnx.merge(graphdef, params)
    token_NxT = next_token_log_probs(model, batch["input_ids"], batch["attention_mask"], head)
    mask_NxT = batch["loss_mask"][:, 1:]
    return (token_NxT * mask_NxT).sum(-1), mask_NxT.sum(-1)


def _pair_terms(graphdef, params, batch, config: DPOConfig, head: LogProbConfig = FUSED):
    """Rows are [chosen (B); rejected (B)]; `ref_logps` (2B) the reference's log-probs."""
    logps, lengths = sequence_log_probs(graphdef, params, batch, head)
    b = logps.shape[0] // 2
    ref = batch["ref_logps"]
    loss, chosen_r, rejected_r = pair_losses(
        logps[:b], logps[b:], ref[:b], ref[b:], lengths[:b], lengths[b:], config
    )
    return loss, chosen_r, rejected_r, logps[:b], logps[b:]


@dataclasses.dataclass(frozen=True)
class DPOObjective:
    """The loss of `loop.train_step` (hashable: a static argument); `head` as
    `models.logprobs` (`sft.training_head`: vocab-parallel on the training mesh)."""

    config: DPOConfig
    head: LogProbConfig = FUSED

    def __call__(self, graphdef, params, batch):
        terms = _pair_terms(graphdef, params, batch, self.config, self.head)
        metrics = dpo_metrics(*terms)
        return metrics.pop("loss"), metrics


_pair_terms_jit = jax.jit(_pair_terms, static_argnums=(0, 3, 4))
_sequence_log_probs = jax.jit(sequence_log_probs, static_argnums=(0, 3))


# ---------------------------------------------------------------------------------- data


def load_preferences(files: str, tokenizer: Tokenizer, data: ConfigDict) -> dict[str, np.ndarray]:
    """Both sides of every pair of the comma-separated `files`, tokenized: `input_ids`,
    `attention_mask`, `loss_mask`, each P×2×max_length (side 0 chosen, 1 rejected).

    Raises:
      ValueError: a missing column, a response that is neither text nor messages, or a side
        longer than `data.max_length` under `truncation="error"` (names file and row).
    """
    parts = []
    for path in [f.strip() for f in files.split(",") if f.strip()]:
        sides = [
            tokenize_pairs(
                read_rows(path, data.prompt_key, key),
                tokenizer,
                data.max_length,
                data.truncation,
                f"{path} ({key})",
            )
            for key in (data.chosen_key, data.rejected_key)
        ]
        parts.append({k: np.stack([s[k] for s in sides], axis=1) for k in sides[0]})
    return {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}


def _rows(pairs: dict[str, np.ndarray], idx: np.ndarray) -> dict[str, np.ndarray]:
    """Pairs `idx` as 2B rows: the chosen sides, then the rejected ones."""
    return {k: np.concatenate([v[idx, 0], v[idx, 1]]) for k, v in pairs.items()}


def _batches(num_pairs: int, bs: int):
    """(indices, real count) covering every pair once in batches of `bs` (the last padded by
    repeating pair 0; padding is left out of every average)."""
    for start in range(0, num_pairs, bs):
        idx = np.arange(start, min(start + bs, num_pairs))
        yield np.concatenate([idx, np.zeros(bs - len(idx), int)]), len(idx)


def reference_log_probs(
    graphdef, params, pairs, bs: int, rows, head: LogProbConfig = FUSED
) -> np.ndarray:
    """The reference's sequence log-probs, P×2 float32 (the model as given; LoRA adapters off).
    One forward pass over the pairs; host sync per batch."""
    params = adapters_off(params)
    out = np.zeros(pairs["input_ids"].shape[:2], np.float32)
    for idx, n in _batches(len(out), bs):
        placed = loop.place(_rows(pairs, idx), rows)
        logps, _ = _sequence_log_probs(graphdef, params, placed, head)
        logps = np.asarray(logps)
        out[idx[:n], 0], out[idx[:n], 1] = logps[:bs][:n], logps[bs:][:n]
    return out


def evaluate(
    graphdef, params, pairs, ref, bs, rows, config: DPOConfig, head: LogProbConfig = FUSED
) -> dict[str, float]:
    """`eval_*` metrics over every validation pair."""
    terms: list[list[np.ndarray]] = [[] for _ in range(5)]
    for idx, n in _batches(len(ref), bs):
        batch = _rows(pairs, idx) | {"ref_logps": np.concatenate([ref[idx, 0], ref[idx, 1]])}
        out = _pair_terms_jit(graphdef, params, loop.place(batch, rows), config, head)
        for acc, value in zip(terms, out, strict=True):
            acc.append(np.asarray(value)[:n])
    arrays = [jnp.asarray(np.concatenate(t)) for t in terms]
    loss, chosen_rewards, rejected_rewards, chosen_logps, rejected_logps = arrays
    metrics = dpo_metrics(
        loss, chosen_rewards, rejected_rewards, chosen_logps, rejected_logps, prefix="eval_"
    )
    # the policy's own preference (not relative to the reference): log π(y_c) > log π(y_r)
    metrics["eval_logps/accuracies"] = (arrays[3] > arrays[4]).mean(dtype=jnp.float32)
    return {k: float(v) for k, v in metrics.items()}


# ---------------------------------------------------------------------------------- the run


def run_dpo(cfg: ConfigDict, overwrite: bool = False) -> dict[str, Any]:
    """Trains per `cfg` (resuming when `trainer.resume_mode=auto`), writes the HF checkpoint,
    and returns the last metrics (with `eval_*` when `data.val_files` is set).

    Args:
      overwrite: let the HF export replace a `trainer.output_dir` that is not empty.
    Raises:
      ValueError: unknown keys, bad `dpo.*` values, unreadable data, a batch size the devices
        do not divide.
      ExportError: `trainer.output_dir` is not empty and `overwrite` is False (checked first).
    """
    check_keys(cfg, dpo_config(), name="DPO")
    config = DPOConfig(**cfg.dpo.to_dict())
    t, bs = cfg.trainer, cfg.data.train_batch_size
    run = loop.setup(cfg, overwrite, load_preferences, build_model)
    graphdef, params, train, val, rows = run.graphdef, run.params, run.train, run.val, run.rows
    head = training_head(run.mesh)  # vocab-parallel on the training mesh, as the RL passes
    reference = loop.on_mesh(run.mesh, reference_log_probs)
    ref_train = reference(graphdef, params, train, bs, rows, head)  # before any resume
    ref_val = None if val is None else reference(graphdef, params, val, bs, rows, head)

    def batch_fn(step: int) -> dict[str, jax.Array]:
        idx = batch_indices(len(ref_train), bs, step, t.seed)
        ref = np.concatenate([ref_train[idx, 0], ref_train[idx, 1]])
        return loop.place(_rows(train, idx) | {"ref_logps": ref}, rows)

    validate = None
    if val is not None:
        validate = lambda p: evaluate(graphdef, p, val, ref_val, bs, rows, config, head)  # noqa: E731
    step_fn = functools.partial(
        loop.train_step, graphdef, run.optim, DPOObjective(config, head), TRL_METRIC_NAMES
    )
    return loop.train_and_export(cfg, run, step_fn, batch_fn, validate, overwrite, "DPO")


def main(argv: list[str]) -> None:
    del argv
    from hybridjax.metrics.console import configure_logging

    t = _CONFIG.value.trainer  # INFO lines to the log file unless --verbosity=0
    configure_logging(os.path.join(t.default_local_dir, "logs", "train.log"))
    with cli_errors("hybridjax.dpo"):
        try:
            run_dpo(_CONFIG.value, _OVERWRITE.value)
        except ValueError as err:
            if isinstance(err, UserError):
                raise
            raise ConfigError(str(err)) from err


def cli() -> None:
    """`python -m hybridjax.dpo`: defines the command-line flags, then runs `main`."""
    global _CONFIG, _OVERWRITE
    from absl import flags
    from ml_collections import config_flags

    from hybridjax.errors import run_main

    _CONFIG = config_flags.DEFINE_config_file("config", None, "DPO config file", lock_config=True)
    _OVERWRITE = flags.DEFINE_bool(
        "overwrite", False, "let the HF export replace a trainer.output_dir that is not empty"
    )
    run_main(main, "hybridjax.dpo")
