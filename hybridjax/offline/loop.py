"""The loop of the offline trainers (`hybridjax.sft`, `hybridjax.dpo`) over pre-tokenized rows.

Each step: the rows of `batch_indices(step)` are placed on the training mesh, one jitted AdamW
step (`train_step`, the trainer's optimizer and schedule) runs the trainer's loss, metrics come
to the host; validation every `trainer.test_freq` steps and at the end; orbax checkpoints every
`trainer.save_freq` steps and at the end, resumed automatically (`trainer.resume_mode=auto`);
at the end the model is written as an HF checkpoint with the tokenizer.

LoRA (`hybridjax.models.lora`): gradients and optimizer state exist for the adapters only, a
checkpoint holds the adapters and their optimizer state (the base is read from `model.path`
again on resume), and the export is the merged model plus the adapters in peft's format
(`<output_dir>/adapter`).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from ml_collections import ConfigDict

from hybridjax.checkpointing import Checkpointer
from hybridjax.checkpointing.export import check_export_target, write_hf_export
from hybridjax.checkpointing.run_lock import hold_outputs
from hybridjax.compilation_cache import set_compilation_cache
from hybridjax.errors import ConfigError
from hybridjax.metrics import Tracking
from hybridjax.metrics.console import announce
from hybridjax.models.decoder import CausalLM
from hybridjax.models.lora import (
    LoRAModel,
    merge_trainable,
    split_trainable,
)
from hybridjax.models.tokenizer import Tokenizer
from hybridjax.sharding import MeshConfig, make_meshes
from hybridjax.sharding.layout import jit_keeping_state
from hybridjax.sharding.mesh import pass_mesh, train_tuple
from hybridjax.sharding.roles import batch_sharding, data_parallel_size
from hybridjax.sharding.validate import expert_problems
from hybridjax.training.build import checkpointed, init_train_state, restored
from hybridjax.training.optim import OptimConfig, learning_rate, make_optimizer, set_learning_rate
from hybridjax.training.update import TrainState

log = logging.getLogger(__name__)

# loss_fn(graphdef, params, batch) -> (scalar loss, metrics dict of scalars); a module-level
# function (it is a static argument of the jitted step).
LossFn = Callable[[nnx.GraphDef, Any, dict[str, jax.Array]], tuple[jax.Array, dict]]


@dataclasses.dataclass(frozen=True)
class WithGradients:
    """A loss that computes its own gradients (e.g. summed over packed buffers in a loop,
    which `jax.value_and_grad` cannot differentiate through):
    `fn(graphdef, trainable, frozen, batch, config) -> ((loss, metrics), grads of trainable)`;
    `fn` is a module-level function and `config` hashable (both are static)."""

    fn: Callable[..., tuple[tuple[jax.Array, dict], Any]]
    config: Any = None


def _train_step(
    graphdef, optim: OptimConfig, loss_fn: LossFn | WithGradients, names, state: TrainState, batch
):
    trainable, frozen = split_trainable(state.params)

    def objective(t):
        return loss_fn(graphdef, merge_trainable(t, frozen), batch)

    if isinstance(loss_fn, WithGradients):
        (loss, metrics), grads = loss_fn.fn(graphdef, trainable, frozen, batch, loss_fn.config)
    else:
        (loss, metrics), grads = jax.value_and_grad(objective, has_aux=True)(trainable)
    lr = learning_rate(optim, state.step)
    opt_state = set_learning_rate(state.opt_state, lr)
    updates, opt_state = make_optimizer(optim).update(grads, opt_state, trainable)
    params = merge_trainable(optax.apply_updates(trainable, updates), frozen)
    loss_name, lr_name, grad_name = names
    metrics = {loss_name: loss, lr_name: lr, grad_name: optax.tree.norm(grads)} | metrics
    return TrainState(params, opt_state, state.step + 1), metrics


# One AdamW step of `loss_fn` (gradients of the trainable part only); `names` = the metric
# names of (loss, learning rate, gradient norm). The state is donated and comes back in its
# input's layout (`hybridjax.sharding.layout`).
train_step = jit_keeping_state(_train_step, static_argnums=(0, 1, 2, 3), state_argnum=4)


def on_mesh(mesh: Mesh, fn: Callable[..., Any]) -> Callable[..., Any]:
    """`fn` called inside `pass_mesh(mesh)`: with `mesh.train.expert` > 1 the MoE layers
    of the jitted passes it runs split their experts over the `expert` axis (`shard_map`,
    `hybridjax.models.moe`); otherwise `fn` as it is."""

    def run(*args, **kwargs):
        with pass_mesh(mesh):
            return fn(*args, **kwargs)

    return run


def fit(
    cfg: ConfigDict,
    graphdef: nnx.GraphDef,
    state: TrainState,
    total_steps: int,
    step_fn: Callable[[TrainState, dict[str, jax.Array]], tuple[TrainState, dict]],
    batch_fn: Callable[[int], dict[str, jax.Array]],
    validate: Callable[[Any], dict[str, float]] | None,
) -> tuple[TrainState, dict[str, float]]:
    """Runs steps (resuming from `trainer.default_local_dir` when `trainer.resume_mode` is
    `auto`) to `total_steps`; returns (final state, last step's metrics).

    Args:
      cfg: the run's config; `trainer.*` is read (`default_local_dir`, `max_ckpt_to_keep`,
        `logger`, `progress_bar`, `project_name`, `experiment_name`, `save_freq`, `test_freq`,
        `val_before_train`, `resume_mode`), and the whole config goes to the loggers.
      step_fn: (state, device batch) -> (state, device metrics), e.g. a partial of `train_step`.
      batch_fn: step (0-based) -> that step's batch, placed on the devices.
      validate: params -> host metrics, or None.
    """
    t = cfg.trainer
    checkpointer = Checkpointer(t.default_local_dir, t.max_ckpt_to_keep)
    start = 0
    if t.resume_mode == "auto" and (saved := checkpointer.restore(checkpointed(state))):
        start, tree, _ = saved
        state = restored(state, tree)
        announce(log, f"resumed from step {start} of {t.default_local_dir}")
    logs = os.path.join(t.default_local_dir, "logs")
    run_name = (t.project_name, t.experiment_name)
    tracker = Tracking(
        t.logger, logs, total_steps, start, t.progress_bar, run_name=run_name, config=cfg.to_dict()
    )
    metrics: dict[str, float] = {}
    try:
        if validate is not None and t.val_before_train and start == 0:
            tracker.log(validate(state.params), 0)
        for step in range(start, total_steps):
            tic = time.perf_counter()
            state, device_metrics = step_fn(state, batch_fn(step))
            metrics = {k: float(v) for k, v in jax.device_get(device_metrics).items()}  # sync
            metrics["timing_s/step"] = time.perf_counter() - tic
            last = step + 1 == total_steps
            if validate is not None and (
                last or (t.test_freq > 0 and (step + 1) % t.test_freq == 0)
            ):
                metrics |= validate(state.params)
            if last or (t.save_freq > 0 and (step + 1) % t.save_freq == 0):
                checkpointer.save(step + 1, checkpointed(state), {"global_step": step + 1})
            tracker.log(metrics, step + 1)
    finally:
        checkpointer.wait()
        checkpointer.close()
        tracker.close()
    return state, metrics


def export(
    model: nnx.Module,
    tokenizer: Tokenizer,
    directory: str,
    base_path: str = "",
    overwrite: bool = False,
    run_dir: str = "",
    inputs: dict[str, str] | None = None,
) -> None:
    """Writes `model` (LoRA: merged) and the tokenizer as an HF checkpoint in `directory`, and
    with LoRA the adapters for peft in `directory/adapter` (`base_path`: the base's HF dir);
    atomically, refusing a non-empty `directory` unless `overwrite` replaces an earlier export,
    and never the run directory `run_dir`, the model directories the run reads `inputs`
    ({config key: path}) or their parents (see `write_hf_export`)."""
    protected = [run_dir] if run_dir else []
    write_hf_export(model, tokenizer, directory, overwrite, base_path, protected, inputs)


def inputs_of(cfg: ConfigDict) -> dict[str, str]:
    """The model directories an offline run reads ({config key: path}, the set ones)."""
    return {
        k: v
        for k, v in (("model.path", cfg.model.path), ("data.tokenizer", cfg.data.tokenizer))
        if v
    }


def train_mesh(cfg: ConfigDict) -> tuple[Mesh, NamedSharding]:
    """The training mesh of `mesh.train` and the sharding of a batch's rows over it."""
    mesh = make_meshes(MeshConfig(train=train_tuple(cfg.mesh.train))).train
    return mesh, batch_sharding(mesh)


def total_steps(cfg: ConfigDict, num_rows: int, data_parallel: int) -> int:
    """`trainer.total_training_steps`, or `total_epochs` × full batches per epoch.

    Raises:
      ValueError: `data.train_batch_size` does not divide over the data-parallel devices or
        exceeds the training rows.
    """
    bs, t = cfg.data.train_batch_size, cfg.trainer
    if bs % data_parallel or num_rows < bs:
        raise ValueError(
            f"data.train_batch_size={bs} must divide over {data_parallel} data-parallel "
            f"devices and be at most the {num_rows} training rows"
        )
    return (
        t.total_training_steps if t.total_training_steps > 0 else t.total_epochs * (num_rows // bs)
    )


def place(rows: dict[str, np.ndarray], sharding) -> dict[str, jax.Array]:
    """Host rows → device arrays split over the batch axis of `sharding`."""
    return {k: jax.device_put(v, sharding) for k, v in rows.items()}


@dataclasses.dataclass(frozen=True)
class Setup:
    """What an offline run builds before its first step (`setup`).

    Attributes:
      out: the HF export directory (`trainer.output_dir`, else `<default_local_dir>/hf`).
      tokenizer: `data.tokenizer`, else `model.path`'s.
      mesh, rows: the training mesh and its batch-row sharding (`train_mesh`).
      train, val: the tokenized rows of `data.train_files` / `data.val_files` (None: none).
      total: optimizer steps of the run (`total_steps`).
      optim: the optimizer (`optim.*`, its schedule over `total` steps).
      graphdef, params: the model (`nnx.split`).
    """

    out: str
    tokenizer: Tokenizer
    mesh: Mesh
    rows: NamedSharding
    train: dict[str, np.ndarray]
    val: dict[str, np.ndarray] | None
    total: int
    optim: OptimConfig
    graphdef: nnx.GraphDef
    params: Any


def setup(
    cfg: ConfigDict,
    overwrite: bool,
    load: Callable[[str, Tokenizer, ConfigDict], dict[str, np.ndarray]],
    build_model: Callable[[ConfigDict, Tokenizer, Mesh], CausalLM | LoRAModel],
) -> Setup:
    """The export target checked first, then the tokenizer, the mesh, the rows
    (`load(files, tokenizer, cfg.data)`), the step count, the optimizer and the model.

    Raises:
      ExportError: `trainer.output_dir` is not empty and `overwrite` is False.
    """
    t = cfg.trainer
    set_compilation_cache(t.compilation_cache_dir)  # before the first compile
    out = t.output_dir or os.path.join(t.default_local_dir, "hf")
    hold_outputs(t.default_local_dir, out)  # one run owns them (until the process exits)
    check_export_target(os.path.abspath(out), overwrite, [t.default_local_dir], inputs_of(cfg))
    tokenizer = Tokenizer.from_pretrained(cfg.data.tokenizer or cfg.model.path)
    mesh, rows = train_mesh(cfg)
    train = load(cfg.data.train_files, tokenizer, cfg.data)
    val = load(cfg.data.val_files, tokenizer, cfg.data) if cfg.data.val_files else None
    total = total_steps(cfg, len(train["input_ids"]), data_parallel_size(mesh))
    optim = OptimConfig.from_config(cfg.optim, cfg.optim.grad_clip, total)
    model = build_model(cfg, tokenizer, mesh)
    problems = expert_problems(dict(mesh.shape), {"model": model.config})
    if problems:
        raise ConfigError("; ".join(problems))
    graphdef, params = nnx.split(model)
    return Setup(out, tokenizer, mesh, rows, train, val, total, optim, graphdef, params)


def train_and_export(
    cfg: ConfigDict,
    run: Setup,
    step_fn: Callable,
    batch_fn: Callable[[int], dict[str, jax.Array]],
    validate: Callable[[Any], dict[str, float]] | None,
    overwrite: bool,
    name: str,
) -> dict[str, Any]:
    """`fit` from fresh optimizer state (or the checkpoint it resumes), the steps and the
    validation on the expert mesh (`on_mesh`), then the HF export of the trained model to
    `run.out`; returns the last metrics."""
    state = init_train_state(run.params, run.optim)
    step_fn = on_mesh(run.mesh, step_fn)
    validate = None if validate is None else on_mesh(run.mesh, validate)
    state, metrics = fit(cfg, run.graphdef, state, run.total, step_fn, batch_fn, validate)
    model = nnx.merge(run.graphdef, state.params)
    export(model, run.tokenizer, run.out, cfg.model.path, overwrite, cfg.trainer.default_local_dir,
           inputs_of(cfg))  # fmt: skip
    print(f"{name} model written to {run.out}", flush=True)
    return metrics
