"""The stages of the RL step as data: the `Stage` declaration (name, batch fields read and
written, model states used), the `Pipeline` of a run (the config's default stages plus the
user's), and what a step reads (`StepDeps`), changes (`StepState`) and shows a user's stage
(`StepContext`).

`hybridjax.rl.step.train_step` calls the default stages itself, in its own order; a pipeline
says which of them a run has and where the user's stages go. A user's stage is a function
`fn(batch, ctx) -> batch` (the name is also its timer, `timing_s/<name>`); `Hooks` runs the
user's stages at the step's named points: those placed before a default stage run right
before it, one that replaces a default stage runs where it would have. A user changes a
pipeline from Python::

    from hybridjax.rl import stage

    @stage(reads=("responses", "token_level_scores"), writes=("token_level_scores",))
    def zero_banned(batch, ctx): ...

    trainer = RLTrainer(cfg, pipeline=default_pipeline(cfg).insert_after("reward", zero_banned))

or from the config: `trainer.stages = ("after reward: my_stages.py:zero_banned",)` (see
`apply_entries`). A pipeline is checked before it runs: every field a stage reads must be
written by an earlier stage, or the error names both.

A user's stage may start work and let a later stage finish it: it returns `Deferred(finish)`,
and `finish(batch, ctx) -> batch` runs, timed under the starting stage's name, right before the
first later stage that reads one of the starting stage's `writes` (or at the end of the step).
The default `reward` stage is finished the same way, so scoring overlaps the log-prob and value
passes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import re
import time
from collections.abc import Callable, Collection, Iterable, Mapping
from typing import Any

import jax
from jax.sharding import NamedSharding
from ml_collections import ConfigDict

from hybridjax.config.run import RunConfig
from hybridjax.data.dataset import PromptLoader
from hybridjax.models.tokenizer import Tokenizer
from hybridjax.rewards.manager import RewardResult
from hybridjax.rl.async_rollout import RolloutAhead
from hybridjax.rl.generation import HostColumns, RolloutWeights, Sampler
from hybridjax.rl.multi_turn import MultiTurn
from hybridjax.rl.reward import RewardStage
from hybridjax.sharding import OffloadConfig
from hybridjax.training.batch import RLBatch
from hybridjax.training.build import Models
from hybridjax.training.passes import StageConfig
from hybridjax.user_code import CodeNotFound, load_module

BATCH_FIELDS = tuple(f.name for f in dataclasses.fields(RLBatch))
# the model states a stage may use (`Stage.uses`; `hybridjax.training.offload` moves them)
MODEL_STATES = ("actor", "actor_optimizer", "ref", "teacher", "critic", "critic_optimizer")


@contextlib.contextmanager
def timed(timing: dict[str, float], name: str):
    """Adds the wall time of the block to `timing[name]` (seconds). The block is a named range
    in JAX profiler traces, and its start and end (`time.time()`) are logged at DEBUG level
    on this module's logger (`stage <name> <start> <end>`; the benchmarks' per-step log)."""
    start, wall = time.perf_counter(), time.time()
    with jax.profiler.TraceAnnotation(name):
        yield
    timing[name] = timing.get(name, 0.0) + time.perf_counter() - start
    logging.getLogger(__name__).debug("stage %s %.6f %.6f", name, wall, time.time())


class PipelineError(ValueError):
    """A pipeline is malformed: an unknown stage or field, or a field read before it is written."""


# a user's stage: `fn(batch, ctx) -> RLBatch | Deferred` (`batch` is None before `gen`)
StageFn = Callable[[Any, "StepContext"], Any]


@dataclasses.dataclass(frozen=True)
class Stage:
    """A named stage of the step (see the module docstring).

    Attributes:
      name: unique within a pipeline; also the timer `timing_s/<name>`.
      fn: a user's stage function `fn(batch, ctx) -> RLBatch | Deferred`; None for the default
        stages, which `hybridjax.rl.step.train_step` calls itself.
      reads, writes: `RLBatch` field names.
      uses: the model states it reads (`MODEL_STATES`; `hybridjax.training.offload`): offloaded
        ones are on the devices while it runs and the other offloaded ones in host memory;
        None (a user's stage unless it says) leaves them where they are.
    """

    name: str
    fn: StageFn | None
    reads: tuple[str, ...] = ()
    writes: tuple[str, ...] = ()
    uses: tuple[str, ...] | None = None

    def __post_init__(self):
        unknown = sorted(set(self.reads + self.writes) - set(BATCH_FIELDS))
        if unknown:
            raise PipelineError(
                f"stage {self.name!r} names unknown batch fields {unknown}; "
                f"valid: {', '.join(BATCH_FIELDS)}"
            )
        states = sorted(set(self.uses or ()) - set(MODEL_STATES))
        if states:
            raise PipelineError(
                f"stage {self.name!r} uses unknown model states {states}; "
                f"valid: {', '.join(MODEL_STATES)}"
            )


def stage(
    name: str | None = None,
    *,
    reads: Iterable[str] = (),
    writes: Iterable[str] = (),
    uses: Iterable[str] | None = None,
) -> Callable[[StageFn], Stage]:
    """Decorator making a `Stage` of `fn(batch, ctx)`; the name defaults to the function's."""
    used = None if uses is None else tuple(uses)
    return lambda fn: Stage(name or fn.__name__, fn, tuple(reads), tuple(writes), used)


@dataclasses.dataclass(frozen=True)
class Deferred:
    """Work a stage started; `finish(batch, ctx) -> batch` completes it (module docstring)."""

    finish: Callable[[RLBatch, StepContext], RLBatch]


@dataclasses.dataclass(frozen=True)
class StepDeps:
    """What a step reads and never changes, built once by the trainer.

    Attributes:
      run: the resolved run config (`hybridjax.config.run.RunConfig`: the ConfigDict, roles,
        shardings, the `StageConfig` of each pool).
      pipeline: the stages this run's step has (the module docstring).
      sampler: samples the step's batch (the sync `gen`).
      rollout_ahead: the rollout thread (`trainer.rollout_mode` one_step_off / async) that
        `gen` takes the batch from; None: `gen` samples with `sampler`.
      weights: re-lays the actor's weights into the engine (`reshard`).
      reward: scores responses (`reward`).
      tokenizer: the actor's tokenizer.
      train_loader: the prompt loader (DAPO's dynamic sampling draws more batches).
      replicated: a replicated sharding on the actor's training mesh (scalar metrics).
      multi_turn: tools of multi-turn rollouts, or None.
      offload: `fsdp_config.*_offload` per role (`place_offloaded` before each stage).
      n_devices, peak_flops: what `perf/*` metrics are computed from, with the actor's shape.
    """

    run: RunConfig
    pipeline: Pipeline
    sampler: Sampler
    rollout_ahead: RolloutAhead | None
    weights: RolloutWeights
    reward: RewardStage
    tokenizer: Tokenizer
    train_loader: PromptLoader
    replicated: NamedSharding
    multi_turn: MultiTurn | None
    offload: Mapping[str, OffloadConfig]
    n_devices: int
    peak_flops: float

    @property
    def config(self) -> ConfigDict:
        """The run's ConfigDict (user stages read their keys here)."""
        return self.run.cfg

    @property
    def stage_cfg(self) -> StageConfig:
        """The `StageConfig` of the passes on the actor's pool."""
        return self.run.stage_cfg


@dataclasses.dataclass(frozen=True)
class StepState:
    """What a step changes: the models (weights and optimizer states) and the adaptive KL
    coefficient (a float32 scalar on the devices)."""

    models: Models
    kl_coef: jax.Array


@dataclasses.dataclass
class Record:
    """A step's timers (seconds per name) and metrics (device scalars or host floats, pulled
    to the host at the end of the step), which the stages add to and never read."""

    timing: dict[str, float] = dataclasses.field(default_factory=dict)
    metrics: dict[str, Any] = dataclasses.field(default_factory=dict)

    def count(self, key: str, value: Any) -> None:
        """Adds `value` to the running sum `metrics[key]` (bytes moved, skipped steps)."""
        self.metrics[key] = self.metrics.get(key, 0.0) + value


@dataclasses.dataclass
class StepContext:
    """What a user's stage sees besides the batch, for one step (`Hooks` keeps it current).

    Attributes:
      step: the RL step (1-based).
      deps: what the step reads and never changes (`StepDeps`: the config, the engine, the
        reward stage, the tokenizer, the loader, the shardings); None in toy pipelines.
      models: the run's models; a user's stage that changes them replaces this field.
      kl_coef: the adaptive KL coefficient (float32 scalar on the devices).
      prompts: this step's batch of prompts from the data loader (what `gen` samples from).
      host: per-row host columns of the batch (data source, ground truth, lengths, ...).
      greedy: (batch, host) of one greedy response per prompt, when an estimator needs it.
      reward: the rule-based reward's `RewardResult` (per-row scores and extras), once scored.
      metrics: this step's metrics (device arrays or floats), pulled to the host at the end.
      timing: seconds per stage name.
    """

    step: int
    deps: StepDeps | None = None
    models: Models | None = None
    kl_coef: jax.Array | None = None
    prompts: dict[str, Any] | None = None
    host: HostColumns | None = None
    greedy: tuple[RLBatch, HostColumns] | None = None
    reward: RewardResult | None = None
    metrics: dict[str, Any] = dataclasses.field(default_factory=dict)
    timing: dict[str, float] = dataclasses.field(default_factory=dict)

    @property
    def config(self) -> ConfigDict:
        """The run's ConfigDict (`deps.config`)."""
        if self.deps is None:
            raise ValueError("ctx.config: this step context has no deps (a toy pipeline)")
        return self.deps.config

    @property
    def stage_config(self) -> StageConfig:
        """The actor pool's `StageConfig` (`deps.stage_cfg`)."""
        if self.deps is None:
            raise ValueError("ctx.stage_config: this step context has no deps (a toy pipeline)")
        return self.deps.stage_cfg


class Pipeline:
    """An ordered tuple of uniquely named stages; edits return a new pipeline.

    Raises:
      PipelineError: two stages share a name.
    """

    def __init__(self, stages: Iterable[Stage | None]):
        self.stages = tuple(s for s in stages if s is not None)  # None: not in this config
        seen = set()
        for s in self.stages:
            if s.name in seen:
                raise PipelineError(f"two stages are named {s.name!r}: {self}")
            seen.add(s.name)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(s.name for s in self.stages)

    def __repr__(self) -> str:
        return " → ".join(self.names)

    def _index(self, name: str) -> int:
        if name not in self.names:
            raise PipelineError(f"no stage named {name!r}; stages: {self}")
        return self.names.index(name)

    def insert_after(self, name: str, new: Stage) -> Pipeline:
        i = self._index(name) + 1
        return Pipeline(self.stages[:i] + (new,) + self.stages[i:])

    def insert_before(self, name: str, new: Stage) -> Pipeline:
        i = self._index(name)
        return Pipeline(self.stages[:i] + (new,) + self.stages[i:])

    def replace(self, name: str, new: Stage) -> Pipeline:
        i = self._index(name)
        return Pipeline(self.stages[:i] + (new,) + self.stages[i + 1 :])

    def remove(self, name: str) -> Pipeline:
        i = self._index(name)
        return Pipeline(self.stages[:i] + self.stages[i + 1 :])

    def check(self, given: Iterable[str] = ()) -> None:
        """Raises PipelineError if a stage reads a field that neither `given` nor an earlier
        stage writes, naming the stage, the field and the stage that writes it (if any)."""
        written = set(given)
        for i, s in enumerate(self.stages):
            for field in s.reads:
                if field not in written:
                    later = [t.name for t in self.stages[i + 1 :] if field in t.writes]
                    where = f"only {later[0]!r}, which runs after it," if later else "no stage"
                    raise PipelineError(
                        f"stage {s.name!r} reads batch field {field!r}, but {where} writes it "
                        f"({self})"
                    )
            written |= set(s.writes)

    def run(self, ctx: StepContext, batch: RLBatch | None = None) -> RLBatch | None:
        """Runs every stage, all of them user stages (`fn` set), on `batch` (None: the first
        stage makes it); each stage's time, including its device work (a sync at its end),
        goes to `ctx.timing[name]`.

        Raises:
          PipelineError: a default stage (no `fn`: `train_step` runs those) is in it.
        """
        hooks = Hooks(self, (), ctx)
        batch, _ = hooks.finish(batch, ctx.models)
        return batch


Placer = Callable[[Models, tuple[str, ...]], Models]


class Hooks:
    """The user's stages of a pipeline, run at the named points of `train_step` (module
    docstring): `before(X, ...)` runs those placed before the default stage `X` (after the
    default stage before it, or in place of one removed or replaced); `finish` runs those
    after the last default stage, then every deferred piece of work.

    Args:
      pipeline: the run's pipeline.
      defaults: the default stages (`hybridjax.rl.step.STAGES`); the others are the user's.
      ctx: what the user's stages see; the step keeps it current (`show`).
      place: `(models, uses) -> models`, the offloaded states `uses` names on the devices and
        the others in host memory, before each user stage that declares `uses`.

    Raises:
      PipelineError: a stage without `fn` that is not a default stage.
    """

    def __init__(
        self,
        pipeline: Pipeline,
        defaults: Collection[Stage],
        ctx: StepContext,
        place: Placer | None = None,
    ):
        self.ctx, self.place = ctx, place
        self.on = {s.name for s in pipeline.stages if any(s is d for d in defaults)}
        self._before: dict[str, list[Stage]] = {}
        waiting: list[Stage] = []
        for s in pipeline.stages:
            if s.name in self.on:
                self._before[s.name], waiting = waiting, []
            elif s.fn is None:
                raise PipelineError(
                    f"stage {s.name!r} has no function: a default stage runs only in its own "
                    "place (hybridjax.rl.step.train_step)"
                )
            else:
                waiting.append(s)
        self._after = waiting
        self._pending: list[tuple[Stage, Deferred]] = []

    def runs(self, point: Stage) -> bool:
        """Whether the default stage `point` runs (the config has it; no edit removed it)."""
        return point.name in self.on

    def show(self, **fields: Any) -> None:
        """Sets `fields` of what the user's stages see (host columns, the reward, ...)."""
        self.ctx = dataclasses.replace(self.ctx, **fields)

    def defer(self, owner: Stage, work: Deferred) -> None:
        """Work `owner` started, finished before the first later reader of `owner.writes`."""
        self._pending.append((owner, work))

    def before(
        self, point: Stage, batch: RLBatch | None, models: Models
    ) -> tuple[RLBatch | None, Models]:
        """Runs the user's stages placed before `point`, then finishes the deferred work
        `point` reads; returns the batch and the models as they left them."""
        self.ctx.models = models
        for s in self._before.get(point.name, ()):
            batch = self._run(s, batch)
        return self._finish(batch, point.reads), self.ctx.models

    def finish(
        self, batch: RLBatch | None, models: Models | None
    ) -> tuple[RLBatch | None, Models | None]:
        """Runs the user's stages after the last default stage, then every deferred piece of
        work; returns the batch and the models."""
        self.ctx.models = models
        for s in self._after:
            batch = self._run(s, batch)
        return self._finish(batch, None), self.ctx.models

    def _run(self, s: Stage, batch: RLBatch | None) -> RLBatch | None:
        ctx = self.ctx
        batch = self._finish(batch, s.reads)
        if self.place is not None and s.uses is not None and ctx.models is not None:
            ctx.models = self.place(ctx.models, s.uses)
        assert s.fn is not None  # (checked in __init__)
        with timed(ctx.timing, s.name):
            out = s.fn(batch, ctx)
            if isinstance(out, Deferred):
                self._pending.append((s, out))
                return batch
            jax.block_until_ready(ctx.metrics)
            return jax.block_until_ready(out)

    def _finish(self, batch, reads: Iterable[str] | None):
        """Finishes the deferred work whose stage writes one of `reads` (None: all of it)."""
        for s, deferred in list(self._pending):
            if reads is None or set(reads) & set(s.writes):
                self._pending.remove((s, deferred))
                with timed(self.ctx.timing, s.name):
                    batch = jax.block_until_ready(deferred.finish(batch, self.ctx))
        return batch


# ------------------------------------------------------------------------- trainer.stages

# "<after|before|replace> <stage>: <module_or_file>:<function>", or "remove <stage>"
_ENTRY = re.compile(r"^\s*(?:(after|before|replace)\s+(\S+?)\s*:\s*(\S+):(\w+)|remove\s+(\S+))\s*$")
_MODULE = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*")  # an importable module's dotted name
_EDITS = {"after": "insert_after", "before": "insert_before", "replace": "replace"}


def load_stage(target: str, function: str) -> Stage:
    """The stage `function` of the Python file or importable module `target`: a `Stage` (from
    `@stage(...)`), or a plain function `fn(batch, ctx)` that becomes a stage named after it,
    with no declared reads or writes.

    Raises:
      PipelineError: `target` is neither a file nor an importable module (a path that does
        not exist is not tried as a module), has a syntax error, fails as it is imported, or
        has no `function`.
    """
    if not os.path.isfile(target) and not _MODULE.fullmatch(target):
        why = "a directory" if os.path.isdir(target) else "no such file"
        raise PipelineError(
            f"trainer.stages: {target!r} is not a file or an importable module ({why}, and not "
            "a module name); give a .py file or a module (a.b.c)"
        )
    try:
        module = load_module(target)
    except CodeNotFound as err:
        raise PipelineError(
            f"trainer.stages: {target!r} is not a file or an importable module ({err})"
        ) from None
    except SyntaxError as err:
        raise PipelineError(
            f"trainer.stages: {err.filename or target}, line {err.lineno}: {err.msg}"
        ) from None
    except (Exception, SystemExit) as err:  # its import-time code raised (or exited)
        first = (str(err).strip().splitlines() or [""])[0]
        raise PipelineError(
            f"trainer.stages: importing {target!r} failed: {type(err).__name__}: {first}"
        ) from None
    found = getattr(module, function, None)
    if isinstance(found, Stage):
        return found
    if not callable(found):
        raise PipelineError(f"trainer.stages: {target!r} has no stage or function {function!r}")
    return Stage(function, found)


def apply_entries(pipeline: Pipeline, entries: Iterable[str]) -> Pipeline:
    """`pipeline` with the `trainer.stages` edits applied in order, then checked.

    Each entry is `"after <stage>: <file.py or module>:<function>"` (or `before`, `replace`),
    or `"remove <stage>"`.

    Raises:
      PipelineError: a malformed entry, an unknown stage, a missing file or function, or a
        stage reading a field no earlier stage writes.
    """
    for entry in entries:
        match = _ENTRY.match(entry)
        if match is None:
            raise PipelineError(
                f"trainer.stages: cannot read {entry!r}; write 'after <stage>: "
                "<file.py or module>:<function>' (or before/replace), or 'remove <stage>'"
            )
        where, anchor, target, function, removed = match.groups()
        if removed:
            pipeline = pipeline.remove(removed)
        else:
            edit = getattr(pipeline, _EDITS[where])
            pipeline = edit(anchor, load_stage(target, function))
    pipeline.check()
    return pipeline
