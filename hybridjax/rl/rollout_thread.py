"""The rollout thread of a run (`trainer.rollout_mode` one_step_off / async), wired to its
engine, sampler, reward and loader: what `RolloutAhead` generates, scores and draws, the
partial rollouts (`trainer.partial_rollout`), and the loader state and prompts in flight a
checkpoint records. `RLTrainer` builds one with `rollout_thread(...)` (None for `sync`).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from typing import Any

import jax
from jax.sharding import NamedSharding
from ml_collections import ConfigDict

from hybridjax.data.dataset import PromptLoader
from hybridjax.rl import step
from hybridjax.rl.async_rollout import RolloutAhead
from hybridjax.rl.generation import Sampler
from hybridjax.rl.partial_rollout import PartialRollout
from hybridjax.rl.pipeline import Pipeline
from hybridjax.rl.reward import RewardStage
from hybridjax.rollout import Engine

log = logging.getLogger(__name__)


class RolloutThread:
    """`RolloutAhead` over the run's sampler (or partial rollouts) and loader.

    Attributes:
      ahead: the thread (`hybridjax.rl.async_rollout`), which `gen` takes batches from.
      partial: the partial rollouts in flight (`trainer.partial_rollout`), or None.

    Raises:
      ValueError: `trainer.partial_rollout` in a run of several processes.
    """

    def __init__(
        self,
        cfg: ConfigDict,
        sampler: Sampler,
        engine: Engine,
        reward: RewardStage,
        loader: PromptLoader,
        total_steps: int,
        batch_sharding: NamedSharding,
        pad_token_id: int,
    ):
        t = cfg.trainer
        self.loader, self.batch_size = loader, cfg.data.train_batch_size
        lag = 1 if t.rollout_mode == "one_step_off" else t.staleness_threshold
        self.partial: PartialRollout | None = None

        def generate(prompts, n):
            batch, host, greedy = sampler.sample(prompts, n)
            return (prompts, batch, host, greedy), len(host.response_lengths)

        set_weights: Callable[[Any, int], None] = lambda params, version: engine.update_weights(
            params
        )
        if t.partial_rollout:  # carried tokens lag one round more (hybridjax.rl.partial_rollout)
            if jax.process_count() > 1:
                raise ValueError("trainer.partial_rollout runs in one process; unset it")
            self.partial = partial = PartialRollout(
                engine,
                cfg.actor_rollout_ref.rollout,
                t.seed,
                pad_token_id,
                batch_sharding,
                t.staleness_threshold,
                kv=t.partial_rollout_kv,
            )

            def generate(batches, n):  # one round per step, requested one step ahead
                for prompts in batches:
                    partial.add(prompts, n)
                prompts, batch, host, versions = partial.batch(n, self.batch_size)
                return (prompts, batch, host, None), versions

            # on demand with staleness_threshold 1: a carried token lags one version more
            set_weights, lag = partial.set_weights, min(1, t.staleness_threshold - 1)

        def score(output, n):  # while the actor trains the step before
            _, batch, host, greedy = output
            greedy_scoring = None if greedy is None else reward.submit(*greedy, n)
            return reward.submit(batch, host, n), greedy_scoring

        self._data_states: list[dict[str, Any]] = []  # before each batch drawn, oldest first
        self._lag = lag
        self.prompts_in_flight = 0  # partial rollouts: queued, not yet handed to a step
        self.ahead = RolloutAhead(
            generate, set_weights, self._next_prompts, lag, total_steps, score
        )

    def _next_prompts(self):
        """The next request's prompts (the caller's thread, in step order)."""
        self._data_states = self._data_states[-self._lag :] + [self.loader.get_state()]
        if self.partial is None:
            return next(self.loader)
        # partial rollouts queue one batch ahead, so that freed slots take its prompts while
        # the batch's long tail runs: each request tops the prompts in flight up to this
        # step's batch and the next one's (this step's alone at the last step), counted from
        # those a checkpoint put back (none after a run's last step)
        size, ahead = self.batch_size, self.ahead
        last = ahead.requested == ahead.total_steps
        batches = []
        while self.prompts_in_flight + len(batches) * size < size * (1 if last else 2):
            batches.append(next(self.loader))
        self.prompts_in_flight += len(batches) * size - size  # this step takes `size`
        return batches

    def data_state(self, global_step: int) -> dict[str, Any]:
        """The loader state after step `global_step`'s batch: batches drawn ahead of training
        are drawn again after a restore."""
        ahead = self.ahead.requested - global_step
        return self._data_states[-ahead] if ahead > 0 else self.loader.get_state()

    @contextlib.contextmanager
    def engine_paused(self) -> Iterator[None]:
        """While entered, the engine is the caller's (validation): the batch being generated
        finishes first, and partial rollouts in flight wait."""
        with self.ahead.engine_lock:
            if self.partial is None:
                yield
            else:
                with self.partial.paused():
                    yield

    def load_partial(self, meta: dict[str, Any], step: int) -> None:
        """Puts back the prompts in flight a checkpoint's `meta` recorded (partial rollouts),
        or warns that a run without them does not train them."""
        if self.partial is not None and "partial_rollout" in meta:
            with self.ahead.engine_lock:
                self.partial.load_state(meta["partial_rollout"])
            self.prompts_in_flight = len(self.partial.groups)
        else:
            warn_partial_dropped(meta, step)

    def close(self) -> None:
        self.ahead.close()


def warn_partial_dropped(meta: dict[str, Any], step: int) -> None:
    """Warns when checkpoint `meta` of `step` holds partial-rollout prompts this run drops."""
    if in_flight := len(meta.get("partial_rollout", {}).get("groups", [])):
        log.warning(
            "the checkpoint of step %d holds %d prompts in flight of a partial-rollout run; "
            "with trainer.partial_rollout off they are not trained (the data order goes on "
            "after them)", step, in_flight,
        )  # fmt: skip


def can_score_ahead(pipeline: Pipeline, reward_model_apart: bool) -> bool:
    """Whether the rollout thread may start scoring each batch right after generating it, so
    the rule functions (and a reward model on its own pool) score batch k+1 while step k
    trains: when `pipeline`'s `reward` stage is the default one and directly follows `gen` (no
    stage in between may change the batch), and a reward model on devices has a pool other
    than the actor's (`reward_model_apart`; else its forward would share the devices of the
    actor's update). The scores are the same either way."""
    names = pipeline.names
    if "reward" not in names:
        return False
    i = names.index("reward")
    default = pipeline.stages[i] in (step.REWARD, step.REWARD_WITH_BASELINE)
    return default and i > 0 and names[i - 1] == "gen" and reward_model_apart


def checkpoint_problems(
    meta: dict[str, Any], loader_state: dict[str, Any], partial: bool
) -> list[str]:
    """How a checkpoint's `meta` does not fit this run: its data-iterator state against the
    loader's (`loader_state`), and with partial rollouts resumed (`partial`) its prompts in
    flight."""
    saved = meta.get("data", {})
    keys = {
        "num_rows": "rows after filtering: data.train_files, data.filter_overlong_prompts",
        "batch_size": "data.train_batch_size",
        "seed": "data.seed",
    }
    problems = [
        f"data iterator {key}: {saved.get(key)} in the checkpoint, {loader_state[key]} with "
        f"this config ({why})"
        for key, why in keys.items()
        if saved.get(key) != loader_state[key]
    ]
    if partial and "partial_rollout" not in meta:
        problems.append(
            "trainer.partial_rollout: the checkpoint has no prompts in flight (saved "
            "without partial rollouts, or by an older version)"
        )
    return problems
