"""`python -m hybridjax.sft --config=configs/sft_arithmetic.py [--config.a.b=value ...]`

Supervised fine-tuning on prompt/response pairs (verl's `fsdp_sft_trainer`): the prompt is
rendered with the tokenizer's chat template (generation prompt added), the response and the EOS
token follow, and the loss is the token-mean negative log-likelihood of the **response tokens
only**. With `model.use_remove_padding` (default) the pairs of a batch are packed end to end
in rows of `data.max_length` tokens (`hybridjax.models.packing`, no padding computed; the
gradient equals the padded one). Same machinery as the RL trainer: an ml_collections config
(`sft_config()` is the schema; unknown keys are rejected), the training mesh and rule table of
the actor, optax AdamW with verl's warmup/cosine schedule (`hybridjax.training.optim`), orbax
checkpoints with automatic resume (`hybridjax.checkpointing`), and metrics to the console /
JSONL / TensorBoard (`hybridjax.metrics.Tracking`, verl's SFT names `train/loss`, `train/lr`,
`val/loss`). At the end the model is written as an HF checkpoint (with the tokenizer) that
`actor_rollout_ref.model.path` loads.

Input: parquet or jsonl files with a prompt column (a list of `{role, content}` messages, or a
plain string taken as one user message) and a response column: a string, or a list of messages
(the assistant turns are joined). A list whose assistant turns are answered by `tool` messages
is a multi-turn trajectory: it is laid out as the multi-turn rollout builds it and the loss
covers the assistant turns only (`response_tokens`).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import os
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np
import pyarrow.parquet as pq
from flax import nnx
from ml_collections import ConfigDict, FieldReference

from hybridjax.errors import ConfigError, InputFileError, cli_errors, run_main
from hybridjax.models import packing
from hybridjax.models.config import DTYPE_CHOICES, ModelConfig
from hybridjax.models.decoder import CausalLM
from hybridjax.models.hf_io import load_pretrained
from hybridjax.models.logprobs import FUSED, LogProbConfig, next_token_log_probs
from hybridjax.models.lora import LoRAConfig, LoRAModel, apply_lora, merge_trainable
from hybridjax.models.tokenizer import Tokenizer
from hybridjax.offline import loop
from hybridjax.sharding import (
    ACTOR_TRAIN_RULES,
    init_sharded,
)
from hybridjax.sharding.roles import data_parallel_size
from hybridjax.sharding.rules import sharding_fn
from hybridjax.tools.chat import tool_response_text
from hybridjax.training.build import dtype_of
from hybridjax.training.forward import response_log_probs

if TYPE_CHECKING:
    from absl import flags

log = logging.getLogger(__name__)
# the command line's flags, defined by `cli` (absl parses them before `main` runs)
_CONFIG: flags.FlagHolder[ConfigDict]
_OVERWRITE: flags.FlagHolder[bool]


def sft_config() -> ConfigDict:
    """Every SFT key with its default (verl's `sft_trainer.yaml` names where it has them)."""
    c = ConfigDict()
    c.data = dict(
        train_files="",
        val_files="",
        tokenizer="",  # tokenizer dir; "" = model.path's
        prompt_key="prompt",
        response_key="response",
        max_length=128,  # prompt + response tokens (after the chat template, with EOS)
        truncation="error",  # error | right
        train_batch_size=64,
    )
    c.model = dict(
        path="",
        override_config=ConfigDict(),
        dtype="auto",  # compute dtype; auto: bfloat16 on GPU/TPU, float32 on CPU
        lora_rank=0,  # > 0: train LoRA adapters only (hybridjax.models.lora)
        lora_alpha=16.0,
        target_modules="all-linear",  # or projection names, e.g. "q_proj,v_proj"
        use_remove_padding=True,  # pack the pairs of a batch end to end (no padding computed)
    )
    c.optim = dict(
        lr=1e-3,
        lr_warmup_steps=-1,
        lr_warmup_steps_ratio=0.05,
        warmup_style="cosine",
        min_lr_ratio=0.1,
        weight_decay=0.0,
        betas=(0.9, 0.999),
        total_training_steps=-1,
        grad_clip=1.0,
    )
    project_name, experiment_name = FieldReference("hybridjax"), FieldReference("sft")
    c.trainer = dict(
        project_name=project_name,  # wandb project; TensorBoard run name (as the RL trainer)
        experiment_name=experiment_name,
        # checkpoints/<project_name>/<experiment_name> unless set (verl's default)
        default_local_dir=FieldReference("checkpoints/") + project_name + "/" + experiment_name,
        output_dir="",  # HF checkpoint written at the end; "" = <default_local_dir>/hf
        total_epochs=1,
        total_training_steps=-1,  # -1: total_epochs × batches per epoch
        seed=0,
        save_freq=-1,  # -1: only at the end
        test_freq=-1,  # -1: validate only at the end (when val_files is set)
        val_before_train=False,  # also validate the starting model (logged as step 0)
        logger=("console", "jsonl"),
        resume_mode="auto",  # auto | disable
        max_ckpt_to_keep=1,
        progress_bar=False,
        # JAX's persistent compilation cache, as the RL trainer's (hybridjax.compilation_cache)
        compilation_cache_dir="auto",
    )
    # expert: expert parallelism of a MoE model (experts split over it; its ranks split the
    # batch like data), as the RL trainer's mesh.train.expert
    c.mesh = dict(train=dict(data=-1, expert=1, fsdp=1, tensor=1))
    return c


def check_keys(
    cfg: ConfigDict, schema: ConfigDict | None = None, prefix: str = "", name: str = "SFT"
) -> None:
    """Raises ValueError naming every key of `cfg` that `schema` (`sft_config()`) lacks."""
    schema = sft_config() if schema is None else schema
    unknown = []
    for key, value in cfg.items():
        if key not in schema:
            unknown.append(prefix + key)
        elif isinstance(value, ConfigDict) and key != "override_config":
            try:
                check_keys(value, schema[key], f"{prefix}{key}.", name)
            except ValueError as e:
                unknown.extend(str(e).removeprefix(f"unknown {name} config keys: ").split(", "))
    if unknown:
        raise ConfigError(f"unknown {name} config keys: {', '.join(unknown)}")


# ---------------------------------------------------------------------------------- data


# a response: one assistant turn, or a trajectory of (role, content) messages (`read_rows`)
Response = str | tuple[tuple[str, str], ...]


def _eos_id(tokenizer: Tokenizer) -> int:
    """The EOS id every response ends with. Raises ConfigError for a tokenizer without one."""
    if tokenizer.eos_token_id is None:
        raise ConfigError("the tokenizer has no eos_token: SFT ends every response with it")
    return tokenizer.eos_token_id


def read_rows(path: str, prompt_key: str, response_key: str) -> list[tuple[Any, Response]]:
    """(prompt, response) pairs of a parquet or jsonl file.

    Raises:
      ValueError: a column is missing or a response is not a string (names file, row, column).
    """
    if not os.path.isfile(path):
        what = "is a directory, not a data file" if os.path.isdir(path) else "no such file"
        raise InputFileError(f"data.train_files/val_files: {path}: {what}")
    if path.endswith(".jsonl"):
        records = []
        with open(path, "rb") as f:
            for line_no, raw in enumerate(f, 1):
                try:
                    if raw.strip():
                        records.append(json.loads(raw.decode("utf-8")))
                except (json.JSONDecodeError, UnicodeDecodeError) as e:
                    raise InputFileError(f"{path}, line {line_no}: not valid JSON ({e})") from e
    else:
        try:
            records = pq.read_table(path).to_pylist()
        except (OSError, ValueError) as e:  # pyarrow's ArrowInvalid is a ValueError
            raise InputFileError(f"{path}: not a readable parquet file ({e})") from e
    rows: list[tuple[Any, Response]] = []
    for i, record in enumerate(records):
        for key in (prompt_key, response_key):
            if key not in record:
                raise InputFileError(
                    f"{path}, row {i}: no column {key!r} (data.prompt_key / data.response_key); "
                    f"has {sorted(record)}"
                )
        response = record[response_key]
        if isinstance(response, list):  # TRL's conversational form: the assistant's turn(s)
            response = _conversation(response, f"{path}, row {i}, column {response_key!r}")
        if not isinstance(response, str | tuple):
            raise InputFileError(
                f"{path}, row {i}, column {response_key!r}: expected a string or a list of "
                "messages with an assistant turn"
            )
        rows.append((record[prompt_key], response))
    return rows


def _conversation(messages: list, where: str) -> str | tuple[tuple[str, str], ...] | None:
    """The assistant turns' text joined, or, when tool messages answer them (a multi-turn
    trajectory), the ("assistant" | "tool", content) messages in order, ending with an
    assistant turn. None without an assistant turn."""
    turns = [m for m in messages if isinstance(m, dict) and m.get("role") in ("assistant", "tool")]
    if not any(m["role"] == "assistant" for m in turns):
        return None
    if all(m["role"] == "assistant" for m in turns):
        return "".join(str(m.get("content", "")) for m in turns)
    roles = [m["role"] for m in turns]
    if roles[0] != "assistant" or roles[-1] != "assistant":
        raise InputFileError(f"{where}: a trajectory starts and ends with an assistant turn")
    return tuple((m["role"], str(m.get("content", ""))) for m in turns)


def response_tokens(tokenizer: Tokenizer, response: Response) -> tuple[list[int], list[float]]:
    """Token ids of a response and their loss mask, the final EOS included.

    A string is one assistant turn (mask 1). A trajectory (`read_rows`) is laid out token in,
    token out as the multi-turn rollout builds it (`hybridjax.rollout.agent_loop`): each
    assistant turn's tokens and the EOS that ends it (mask 1), then the tool messages that answer
    it rendered once with the chat template's tool role (`tool_response_text`, mask 0), so the
    model learns its calls and answers, never the tools' responses.
    """
    eos = _eos_id(tokenizer)
    if isinstance(response, str):
        text_ids = tokenizer.encode(response) + [eos]
        return text_ids, [1.0] * len(text_ids)
    ids: list[int] = []
    mask: list[float] = []
    k = 0
    while k < len(response):
        if response[k][0] == "assistant":
            part, value = tokenizer.encode(response[k][1]) + [eos], 1.0
            k += 1
        else:
            contents = []
            while response[k][0] == "tool":
                contents.append(response[k][1])
                k += 1
            part, value = tokenizer.encode(tool_response_text(tokenizer, contents)), 0.0
        ids += part
        mask += [value] * len(part)
    return ids, mask


def tokenize_pairs(
    pairs: list[tuple[Any, Response]],
    tokenizer: Tokenizer,
    max_length: int,
    truncation: str,
    path: str = "",
) -> dict[str, np.ndarray]:
    """Right-padded `input_ids`, `attention_mask`, `loss_mask` (N×max_length, int32/float32).

    `loss_mask` is 1 on response tokens and the EOS after them, 0 on the prompt, on the tool
    messages of multi-turn responses (`response_tokens`) and on padding.
    Raises:
      ValueError: a pair is longer than `max_length` under `truncation="error"` (names the row).
    """
    eos = _eos_id(tokenizer)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos
    n = len(pairs)
    ids = np.full((n, max_length), pad, np.int32)
    attention = np.zeros((n, max_length), np.int32)
    loss = np.zeros((n, max_length), np.float32)
    prompts = [[{"role": "user", "content": p}] if isinstance(p, str) else p for p, _ in pairs]
    prompt_ids = tokenizer.encode_batch([tokenizer.render_chat(m) for m in prompts])
    texts = [r for _, r in pairs if isinstance(r, str)]
    if len(texts) == n:  # one batched call for plain responses
        encoded = tokenizer.encode_batch(texts)
        responses = [(r + [eos], [1.0] * (len(r) + 1)) for r in encoded]
    else:
        responses = [response_tokens(tokenizer, r) for _, r in pairs]
    for i, (p, (r, r_mask)) in enumerate(zip(prompt_ids, responses, strict=True)):
        seq, seq_mask = p + r, [0.0] * len(p) + r_mask
        if len(seq) > max_length:
            if truncation == "error":
                raise InputFileError(
                    f"{path} row {i}: {len(seq)} tokens > data.max_length={max_length}; "
                    "raise it or set data.truncation=right"
                )
            seq, seq_mask = seq[:max_length], seq_mask[:max_length]
        ids[i, : len(seq)] = seq
        attention[i, : len(seq)] = 1
        loss[i, : len(seq)] = seq_mask
    return {"input_ids": ids, "attention_mask": attention, "loss_mask": loss}


def load_split(files: str, tokenizer: Tokenizer, data: ConfigDict) -> dict[str, np.ndarray]:
    """Every pair of the comma-separated `files`, tokenized (see `tokenize_pairs`)."""
    parts = []
    for path in [f.strip() for f in files.split(",") if f.strip()]:
        pairs = read_rows(path, data.prompt_key, data.response_key)
        parts.append(tokenize_pairs(pairs, tokenizer, data.max_length, data.truncation, path))
    return {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}


def batch_indices(num_rows: int, batch_size: int, step: int, seed: int) -> np.ndarray:
    """Rows of training step `step` (0-based): epoch e = step // batches_per_epoch reads a
    permutation seeded by (seed, e); the last partial batch of an epoch is dropped. A pure
    function of the step, so resuming at a step reads exactly the batches it would have."""
    per_epoch = num_rows // batch_size
    epoch, k = divmod(step, per_epoch)
    order = np.random.default_rng([seed, epoch]).permutation(num_rows)
    return order[k * batch_size : (k + 1) * batch_size]


# ---------------------------------------------------------------------------------- steps


def sft_loss(
    graphdef, params, batch: dict[str, jax.Array], head: LogProbConfig = FUSED
) -> tuple[jax.Array, jax.Array]:
    """(sum of response-token NLL, number of response tokens), float32. Token t's target is
    token t+1, so the loss mask is shifted by one; `head` as `models.logprobs`."""
    model = nnx.merge(graphdef, params)
    log_probs = next_token_log_probs(model, batch["input_ids"], batch["attention_mask"], head)
    mask_BxT = batch["loss_mask"][:, 1:]
    return -(log_probs * mask_BxT).sum(), mask_BxT.sum()


def sft_objective(
    graphdef, params, batch: dict[str, jax.Array], head: LogProbConfig = FUSED
) -> tuple[jax.Array, dict]:
    """Token-mean response NLL (the loss of `loop.train_step`), no extra metrics."""
    total, count = sft_loss(graphdef, params, batch, head)
    return total / jnp.maximum(count, 1.0), {}


SFT_METRIC_NAMES = ("train/loss", "train/lr", "train/grad_norm")  # verl's SFT names
_eval_loss = jax.jit(sft_loss, static_argnums=(0, 3))


def packed_sft_gradients(
    graphdef,
    trainable,
    frozen,
    batch,
    config: packing.PackingConfig,
    head: LogProbConfig = FUSED,
):
    """((token-mean response NLL, {}), its gradient w.r.t. `trainable`) over packed buffers of
    the batch: each pair is one sequence (no shared prompt), buffers summed in a
    `lax.while_loop`; equal to `value_and_grad` of the padded `sft_objective`; `head` as
    `models.logprobs`."""
    ids, mask = batch["input_ids"], batch["attention_mask"]
    b, length = ids.shape
    target_mask = batch["loss_mask"].at[:, 0].set(0.0)  # token 0 has no prediction
    count = jnp.maximum(target_mask.sum(), 1.0)
    fields = {"input_ids": ids, "attention_mask": mask, "responses": ids}
    pl = packing.plan(ids, mask, length, jnp.arange(b), config)

    def loss_k(t, step_plan, k):
        f = dict(fields, pack_plan=step_plan, pack_buffer=k)
        params = merge_trainable(t, frozen)
        log_probs, _ = response_log_probs(graphdef, params, f, 1.0, head=head)
        return -(log_probs * target_mask).sum() / count

    def body(step_plan, k, acc):
        value_and_grad = jax.value_and_grad(loss_k)(trainable, step_plan, k)
        return jax.tree.map(jnp.add, acc, value_and_grad)

    zeros = jax.tree.map(jnp.zeros_like, (jnp.float32(0), trainable))
    loss, grads = packing.over_buffers(pl, body, zeros)
    return (loss, {}), grads


# ---------------------------------------------------------------------------------- the run


def training_head(mesh) -> LogProbConfig:
    """The fused head on the training mesh, as the RL passes run it (`LogProbConfig.mesh`):
    vocab-parallel when `mesh.train.tensor` / `fsdp` split the vocabulary, so the LM head
    and its gradient are never gathered (docs/memory.md)."""
    return dataclasses.replace(FUSED, mesh=mesh)


def build_model(cfg: ConfigDict, tokenizer: Tokenizer, mesh) -> CausalLM | LoRAModel:
    """`model.path` (an HF checkpoint) or a random model shaped by `model.override_config`;
    wrapped in fresh LoRA adapters when `model.lora_rank` > 0."""
    lora = LoRAConfig.from_config(cfg.model, "model")
    overrides: dict[str, Any] = {"dtype": dtype_of(cfg.model.dtype)}
    overrides |= dict(cfg.model.override_config)
    if cfg.model.path:
        shardings = sharding_fn(mesh, ACTOR_TRAIN_RULES)
        model = load_pretrained(cfg.model.path, shardings=shardings, config_overrides=overrides)
    else:
        config = ModelConfig(
            vocab_size=tokenizer.vocab_size,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
            bos_token_id=tokenizer.bos_token_id,
            **overrides,
        )
        model = init_sharded(CausalLM, config, mesh, ACTOR_TRAIN_RULES, cfg.trainer.seed)
    return apply_lora(model, lora, cfg.trainer.seed) if lora.enabled else model


def run_sft(cfg: ConfigDict, overwrite: bool = False) -> dict[str, Any]:
    """Trains per `cfg` (resuming from `trainer.default_local_dir` when `resume_mode=auto`),
    writes the HF checkpoint, and returns the last metrics (with `val/loss` if validated).

    Args:
      overwrite: let the HF export replace a `trainer.output_dir` that is not empty.
    Raises:
      ConfigError: unknown config keys, a value outside its choices, a batch size the devices
        do not divide.
      InputFileError: unreadable data, tokenizer or model files.
      ExportError: `trainer.output_dir` is not empty and `overwrite` is False (checked first).
    """
    check_keys(cfg)
    t = cfg.trainer
    for key, value, choices in (
        ("trainer.resume_mode", t.resume_mode, ("auto", "disable")),
        ("data.truncation", cfg.data.truncation, ("error", "right")),
        ("model.dtype", cfg.model.dtype, DTYPE_CHOICES),
    ):
        if value not in choices:
            raise ConfigError(f"{key}: one of {choices} (got {value!r})")
    run = loop.setup(cfg, overwrite, load_split, build_model)
    graphdef, train, val, rows = run.graphdef, run.train, run.val, run.rows
    bs = cfg.data.train_batch_size
    head = training_head(run.mesh)
    objective: loop.LossFn | loop.WithGradients = functools.partial(sft_objective, head=head)
    if cfg.model.use_remove_padding:  # rows of max_length; budget = the padded batch's tokens
        pieces = data_parallel_size(run.mesh)
        packed = packing.PackingConfig(cfg.data.max_length, max(bs // pieces, 1), pieces, False)
        objective = loop.WithGradients(functools.partial(packed_sft_gradients, head=head), packed)
    step_fn = functools.partial(loop.train_step, graphdef, run.optim, objective, SFT_METRIC_NAMES)
    num_rows = len(train["input_ids"])
    batch_fn = lambda step: loop.place(  # noqa: E731
        {k: v[batch_indices(num_rows, bs, step, t.seed)] for k, v in train.items()}, rows
    )
    validate = None
    if val is not None:
        validate = lambda p: {"val/loss": validation_loss(graphdef, p, val, bs, rows, head)}  # noqa: E731
    return loop.train_and_export(cfg, run, step_fn, batch_fn, validate, overwrite, "SFT")


def validation_loss(
    graphdef, params, val: dict[str, np.ndarray], bs: int, rows, head: LogProbConfig = FUSED
) -> float:
    """Token-mean response NLL over the validation rows (the last partial batch padded with
    rows whose loss mask is zero, so every batch has one compiled shape)."""
    total = count = 0.0
    n = len(val["input_ids"])
    for start in range(0, n, bs):
        batch = {k: v[start : start + bs] for k, v in val.items()}
        short = bs - len(batch["input_ids"])
        if short:
            batch = {k: np.concatenate([v, np.zeros_like(v[:short])]) for k, v in batch.items()}
        placed = {k: jax.device_put(v, rows) for k, v in batch.items()}
        s, c = _eval_loss(graphdef, params, placed, head)
        total, count = total + float(s), count + float(c)
    return total / max(count, 1.0)


def main(argv: list[str]) -> None:
    del argv
    from hybridjax.metrics.console import configure_logging

    t = _CONFIG.value.trainer  # INFO lines to the log file unless --verbosity=0
    configure_logging(os.path.join(t.default_local_dir, "logs", "train.log"))
    with cli_errors("hybridjax.sft"):
        run_sft(_CONFIG.value, _OVERWRITE.value)


def cli() -> None:
    """`python -m hybridjax.sft`: defines the command-line flags, then runs `main`."""
    global _CONFIG, _OVERWRITE
    from absl import flags
    from ml_collections import config_flags

    _CONFIG = config_flags.DEFINE_config_file("config", None, "SFT config file", lock_config=True)
    _OVERWRITE = flags.DEFINE_bool(
        "overwrite", False, "let the HF export replace a trainer.output_dir that is not empty"
    )
    run_main(main, "hybridjax.sft")
