"""The RL step as a pipeline of named stages that users extend without editing the trainer.

A `Stage` is a function `fn(batch, ctx) -> batch` with a name and the `RLBatch` fields it reads
and writes. The name is also its timer: the pipeline reports the stage's wall time, device work
included, as `timing_s/<name>`. `ctx` is the step's `StepContext` (the step number, the models,
the config, the host columns of the batch, the metrics). The default pipelines are built from
the config in `hybridjax.rl.step`; a user changes one from Python::

    from hybridjax.rl import stage

    @stage(reads=("responses", "token_level_scores"), writes=("token_level_scores",))
    def zero_banned(batch, ctx): ...

    trainer = RLTrainer(cfg, pipeline=default_pipeline(cfg).insert_after("reward", zero_banned))

or from the config: `trainer.stages = ("after reward: my_stages.py:zero_banned",)` (see
`configured_pipeline`). A pipeline is checked before it runs: every field a stage reads must be
written by an earlier stage, or the error names both.

A stage may start work and let a later stage finish it: it returns `Deferred(finish)`, and
`finish(batch, ctx) -> batch` runs, timed under the starting stage's name, right before the
first later stage that reads one of the starting stage's `writes` (or at the end). The reward
stage uses this so scoring overlaps the log-prob and value passes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import re
import time
from collections.abc import Callable, Iterable
from typing import Any

import jax

from hybridjax.training.batch import RLBatch
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


@dataclasses.dataclass(frozen=True)
class Stage:
    """A named step of the pipeline (see the module docstring).

    Attributes:
      name: unique within a pipeline; also the timer `timing_s/<name>`.
      fn: `fn(batch, ctx) -> RLBatch | Deferred` (`batch` is None before the first stage).
      reads, writes: `RLBatch` field names.
      uses: the model states it reads (`MODEL_STATES`; `hybridjax.training.offload`): offloaded
        ones are on the devices while it runs and the other offloaded ones in host memory;
        None (a user's stage unless it says) leaves them where they are.
    """

    name: str
    fn: Callable[[Any, Any], Any]
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
) -> Callable[[Callable], Stage]:
    """Decorator making a `Stage` of `fn(batch, ctx)`; the name defaults to the function's."""
    used = None if uses is None else tuple(uses)
    return lambda fn: Stage(name or fn.__name__, fn, tuple(reads), tuple(writes), used)


@dataclasses.dataclass(frozen=True)
class Deferred:
    """Work a stage started; `finish(batch, ctx) -> batch` completes it (module docstring)."""

    finish: Callable[[RLBatch, Any], RLBatch]


@dataclasses.dataclass
class StepContext:
    """What a stage may use besides the batch, for one step.

    Attributes:
      step: the RL step (1-based).
      deps: what the step reads and never changes (`hybridjax.rl.step.StepDeps`: the config,
        the engine, the reward stage, the tokenizer, the loader, the shardings); None in toy
        pipelines that need none of it.
      models: the run's models (`hybridjax.training.build.Models`); a stage that changes them
        (an update, an offload) replaces this field, and the step returns it.
      kl_coef: the adaptive KL coefficient (float32 scalar on the devices); `adv` replaces it.
      prompts: this step's batch of prompts from the data loader (what `gen` samples from).
      host: per-row host columns of the batch (data source, ground truth, lengths, ...).
      greedy: (batch, host) of one greedy response per prompt, when an estimator needs it.
      reward: the rule-based reward's `RewardResult` (per-row scores and extras).
      metrics: this step's metrics (device arrays or floats), pulled to the host at the end.
      timing: seconds per stage name.
      pipeline: the pipeline running this step.
      gen_batches: generation batches sampled so far this step (each gets its own seed).
      scoring: (PendingScores, greedy PendingScores or None) of this step's batch, started by
        the rollout thread as soon as it generated the batch (None: the `reward` stage starts
        them).
      policy_versions: per row, the policy version that generated it (rollout ahead only;
        with partial rollouts its oldest token's).
      token_versions: with partial rollouts, the version of each response token (B×R int64,
        -1 past the end).
    """

    step: int
    deps: Any = None
    models: Any = None
    kl_coef: Any = None
    prompts: dict[str, Any] | None = None
    host: Any = None
    greedy: Any = None
    reward: Any = None
    metrics: dict[str, Any] = dataclasses.field(default_factory=dict)
    timing: dict[str, float] = dataclasses.field(default_factory=dict)
    pipeline: Pipeline | None = None
    gen_batches: int = 0
    scoring: Any = None
    policy_versions: Any = None
    token_versions: Any = None

    @property
    def config(self):
        """The run's ConfigDict (`deps.config`)."""
        return self.deps.config

    @property
    def stage_config(self):
        """The actor pool's `StageConfig` (`deps.stage_cfg`)."""
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

    def before(self, name: str) -> Pipeline:
        """The stages before `name` (e.g. what to run again for another generation batch)."""
        return Pipeline(self.stages[: self._index(name)])

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

    def run(self, ctx: StepContext, batch: RLBatch | None = None) -> RLBatch:
        """Runs every stage on `batch` (None: the first stage makes it); each stage's time,
        including its device work (a sync at its end), goes to `ctx.timing[name]`."""
        return Runner(self, ctx).finish(batch)


class Runner:
    """Runs a pipeline's stages in order for one step, at the named points of the function
    that drives it (`hybridjax.rl.step.train_step`): `runner(STAGE, batch)` runs the stages
    not run yet up to the one named `STAGE.name` (the default stage, or the edit that
    replaced it, with the user's stages placed before it), and nothing when the pipeline has
    no stage of that name (the config left it out, or an edit removed it); `finish` runs the
    rest and completes the deferred work (module docstring). `before(stage, ctx)`, if given,
    runs before each stage, outside its timer (the step places offloaded states there)."""

    def __init__(
        self,
        pipeline: Pipeline,
        ctx: StepContext,
        before: Callable[[Stage, StepContext], None] | None = None,
    ):
        self.pipeline, self.ctx, self.before = pipeline, ctx, before
        self._next = 0  # index of the first stage not run yet
        self._pending: list[tuple[Stage, Deferred]] = []
        ctx.pipeline = pipeline

    def __call__(self, point: Stage, batch: RLBatch | None) -> RLBatch | None:
        names = self.pipeline.names
        if point.name not in names:
            return batch
        return self._run_until(names.index(point.name) + 1, batch)

    def finish(self, batch: RLBatch | None) -> RLBatch:
        """Runs the stages left, then finishes every deferred piece of work."""
        batch = self._run_until(len(self.pipeline.stages), batch)
        return _finish(self._pending, self.ctx, batch, None)

    def _run_until(self, end: int, batch):
        ctx = self.ctx
        for s in self.pipeline.stages[self._next : end]:
            batch = _finish(self._pending, ctx, batch, s.reads)
            if self.before is not None:
                self.before(s, ctx)
            with timed(ctx.timing, s.name):
                out = s.fn(batch, ctx)
                if isinstance(out, Deferred):
                    self._pending.append((s, out))
                else:
                    batch = jax.block_until_ready(out)
                    jax.block_until_ready(ctx.metrics)
        self._next = max(self._next, end)
        return batch


def _finish(pending, ctx: StepContext, batch, reads: Iterable[str] | None):
    """Finishes the deferred work whose stage writes one of `reads` (None: all of it)."""
    for s, deferred in list(pending):
        if reads is None or set(reads) & set(s.writes):
            pending.remove((s, deferred))
            with timed(ctx.timing, s.name):
                batch = jax.block_until_ready(deferred.finish(batch, ctx))
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
