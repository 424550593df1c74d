"""The `reward` stage: rule-based scores (`hybridjax.rewards.RewardManager`) and/or a reward
model, co-located or served, and the greedy-rollout baselines of estimators that ask for them
(ReMax).

`submit` starts the work and returns at once (rule functions run in the reward manager's workers
or on reward servers, the co-located reward-model forward is queued on the device, a served one
is posted from a thread), so the trainer can run the log-prob and value passes meanwhile;
`collect` waits for it. With a rollout ahead of training (`trainer.rollout_mode`), the rollout
thread calls `submit` as soon as it has generated a batch, so scoring overlaps the previous
step's training too. With a reward model, `reward_model.combine` says what goes into
`token_level_scores`: `replace` (verl's) the model's score alone, `sum` rule + model; the rule's
result (and its metrics) is computed either way.

Where the reward model runs: `reward_model.enable` with `model.path` loads it here; `enable`
with an empty `model.path` and `remote.urls` scores on model servers
(`python -m hybridjax.rewards.serve --model_path ...`), sending the token ids of prompt and
response (the server's model must share the actor's tokenizer, as a co-located one does).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.multihost_utils import process_allgather
from jax.sharding import NamedSharding

from hybridjax.models.packing import PackingConfig
from hybridjax.models.tokenizer import Tokenizer
from hybridjax.rewards import (
    RewardConfig,
    RewardManager,
    RewardResult,
    concat_results,
    decode_responses,
    place_scores,
)
from hybridjax.rewards.genrm import JudgeConfig, judge_metrics
from hybridjax.rewards.manager import check_outcomes, serves_model
from hybridjax.rewards.remote import RemoteClient, RemoteConfig
from hybridjax.rewards.reward_model import score_responses
from hybridjax.rewards.scoring import Outcome
from hybridjax.rl.generation import HostColumns, put_global
from hybridjax.sharding import load_to_device
from hybridjax.sharding.hosts import allgather
from hybridjax.sharding.mesh import batch_shards, pass_mesh
from hybridjax.sharding.pools import move_rows
from hybridjax.training.batch import RLBatch
from hybridjax.training.build import forward_micro_batch
from hybridjax.training.packing import packing_configs


def submit_rewards(
    manager: RewardManager, tokenizer: Tokenizer, host: HostColumns
) -> concurrent.futures.Future[RewardResult]:
    """Decodes this process's responses and starts scoring them (returns at once)."""
    host = host.share()
    texts = decode_responses(tokenizer, host.responses, host.valid_mask)
    return manager.submit(
        texts,
        host.data_source,
        host.ground_truth,
        host.extra_info,
        host.response_lengths,
        host.responses.shape[1],
    )


def collect_rewards(pending: concurrent.futures.Future[RewardResult]) -> RewardResult:
    """Waits for this process's scores and gathers every process's, in row order."""
    return concat_results(allgather(pending.result()))


def check_reward_servers(cfg) -> None:
    """Health-checks every `reward_model.remote.urls` for the kind the config needs (the model
    when `serves_model`, else the rule), before anything slow is loaded.

    Raises:
      RewardServerError: a URL is unreachable or serves the other kind (named in the message).
    """
    remote = RemoteConfig.from_dict(cfg.reward_model.remote)
    if remote.urls:
        RemoteClient(remote, served_kind(cfg.reward_model)).close()


def served_kind(rm) -> str:
    """What `reward_model.remote.urls` serve: `judge` (a generative reward model), `model`
    (a reward model, `serves_model`) or `rule`."""
    if serves_model(rm):
        return "judge" if rm.generative.enable else "model"
    return "rule"


# (prompt texts, response texts, ground truths) -> one outcome per row
JudgeFn = Callable[[Sequence[str], Sequence[str], Sequence[Any]], list[Outcome]]


@dataclasses.dataclass(frozen=True)
class PendingScores:
    """Scores of one batch being computed: the rule's future and the reward model's B×R token
    scores (queued on the device, or a future of (host B×R scores, metrics) from model servers;
    None without a reward model); `transfer_bytes`, what copying the inputs to a reward model on
    its own pool wrote."""

    rule: concurrent.futures.Future[RewardResult]
    model: jax.Array | concurrent.futures.Future | None
    transfer_bytes: int = 0


class RewardStage:
    """Scores responses for the `reward` stage.

    Args:
      manager: the rule-based reward manager (`reward_model.on_error`, custom functions, ...).
      tokenizer: decodes responses for the rule functions.
      reward_model: (graphdef, params) of a `SequenceClassifier` or None.
      micro_batch_size_per_device: `reward_model.micro_batch_size_per_gpu`.
      sharding: where per-row arrays go (the training mesh's batch axes).
      data_parallel: batch shards of the training mesh (data × expert × fsdp).
      model_client: a `RemoteClient` of kind `model` (served reward model) or None.
      combine: `reward_model.combine`, `replace` or `sum`.
      packing: the reward model's packed forward (`trainer.packing`), or None (padded).
      model_sharding: the batch axes of the reward model's own pool when it is not the
        actor's (`placement.reward_model`): its inputs move there and its scores back; None
        when they share one.
      judge: a generative reward model (`reward_model.generative`): a local
        `hybridjax.rewards.genrm.Judge.score` or a judge server's `RemoteClient.judge` (then
        `model_client` is that client); it replaces `reward_model` and runs on the stage's
        thread, so the trainer's device stages run meanwhile.
    """

    def __init__(
        self,
        manager: RewardManager,
        tokenizer: Tokenizer,
        reward_model: tuple[Any, Any] | None,
        micro_batch_size_per_device: int,
        sharding: NamedSharding,
        data_parallel: int,
        model_client: RemoteClient | None = None,
        combine: str = "replace",
        packing: PackingConfig | None = None,
        model_sharding: NamedSharding | None = None,
        judge: JudgeFn | None = None,
    ):
        self.manager = manager
        self.judge = judge
        self.tokenizer = tokenizer
        self.reward_model = reward_model
        self.micro_per_device = micro_batch_size_per_device
        self.sharding = sharding
        self.data_parallel = data_parallel
        self.packing = packing
        self.model_client = model_client
        self.combine = combine
        self.model_sharding = model_sharding
        self._model_batches = 0
        self._posts = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="reward-model")
        # ("reward", step, start, end) per scored batch, `time.perf_counter()` seconds from
        # `submit` to both scores done (the benchmarks' timeline); a thread waits for them
        self.events: list[tuple[str, int, float, float]] = []
        self._watch = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="reward-watch")

    @classmethod
    def from_config(
        cls, cfg, tokenizer, reward_model, sharding, data_parallel, model_sharding=None,
        judge=None,
    ) -> RewardStage:  # fmt: skip
        """The stage of a trainer config (`reward_model.*`, `custom_reward_function.*`);
        `judge`, a local judge's `score` (`genrm.load_judge`) when `reward_model.generative`
        has a `model.path`.

        Raises:
          RewardServerError: a reward server fails its health check (names the URL).
        """
        rm = cfg.reward_model
        config = RewardConfig.from_config(cfg)
        client = None
        if serves_model(rm):
            client = RemoteClient(RemoteConfig.from_dict(rm.remote), served_kind(rm))
            if rm.generative.enable:
                JudgeConfig.from_dict(rm.generative)  # the server's, but checked here too
                judge = client.judge
        return cls(
            RewardManager(config),
            tokenizer,
            reward_model,
            rm.micro_batch_size_per_gpu,
            sharding,
            data_parallel,
            client,
            config.combine,
            packing_configs(cfg, _model_data_parallel(model_sharding, data_parallel))[
                "reward_model"
            ],
            model_sharding,
            judge,
        )

    def submit(self, batch: RLBatch, host: HostColumns, step: int = 0) -> PendingScores:
        """Starts scoring `batch` of RL step `step` (returns at once; no host sync). May run on
        the rollout thread (`trainer.rollout_mode` one_step_off / async): the rule functions
        score in order in the reward manager's worker, a reward model on its own pool queues
        its forward there."""
        start = time.perf_counter()
        rule = submit_rewards(self.manager, self.tokenizer, host)
        model, nbytes = None, 0
        if self.reward_model is not None:
            model, nbytes = self.model_scores(batch)
        elif self.model_client is not None or self.judge is not None:
            # Host sync (small): every process gets the whole batch's prompt ids.
            prompts, mask = process_allgather((batch.prompts, batch.attention_mask), tiled=True)
            prompt_mask = np.asarray(mask)[:, : prompts.shape[1]].astype(bool)
            score = self._score_judged if self.judge is not None else self._score_served
            model = self._posts.submit(score, prompts, prompt_mask, host)
        pending = PendingScores(rule, model, nbytes)
        self._watch.submit(self._record, pending, step, start)
        return pending

    def model_scores(self, batch: RLBatch) -> tuple[jax.Array, int]:
        """The reward model's `token_level_scores` (B×R float32, queued: no host sync) on its
        pool's mesh (the actor's training mesh when it shares it), and the bytes moved there.
        The forward runs inside `pass_mesh` of that mesh: a MoE reward model's experts
        split over its `expert` axis, as in the actor's passes. Raises ValueError without a
        reward model."""
        if self.reward_model is None:
            raise ValueError("this reward stage has no reward model (reward_model.model.path)")
        graphdef, params = self.reward_model
        # a device copy for this forward only when the model lives in host memory
        # (`reward_model.model.fsdp_config.param_offload`); no-op on the devices
        params = load_to_device(params)
        inputs = (
            batch.prompts,
            batch.attention_mask[:, : batch.prompts.shape[1]],
            batch.responses,
            batch.response_mask,
        )
        dp = _model_data_parallel(self.model_sharding, self.data_parallel)
        nbytes = 0
        if self.model_sharding is not None:  # the model's own pool (async copy there)
            inputs, nbytes = move_rows(inputs, self.model_sharding)
        with pass_mesh((self.model_sharding or self.sharding).mesh):
            scores, _ = score_responses(
                graphdef,
                params,
                *inputs,
                micro_batch_size=forward_micro_batch(self.micro_per_device, batch.batch_size, dp),
                packing=self.packing,
            )
        return scores, nbytes

    def _record(self, pending: PendingScores, step: int, start: float) -> None:
        """Waits for both scores (on the watch thread) and records the batch's span; failures
        are `collect`'s to raise."""
        try:
            pending.rule.result()
            model = pending.model
            model.result() if isinstance(model, concurrent.futures.Future) else (
                jax.block_until_ready(model)
            )
        except BaseException:  # noqa: BLE001 - reported by `collect`
            return
        self.events.append(("reward", step, start, time.perf_counter()))

    def _score_served(self, prompts, prompt_mask, host: HostColumns):
        """(B×R float32 token scores, metrics) from the model servers; failures follow
        `reward_model.on_error` like a rule's."""
        self.model_client.reset_counters()
        mask = host.response_mask.astype(bool)
        outcomes = self.model_client.score_tokens(
            [p[m].tolist() for p, m in zip(np.asarray(prompts), prompt_mask, strict=True)],
            [r[m].tolist() for r, m in zip(host.responses, mask, strict=True)],
        )
        return self._placed(outcomes, host, {})

    def _score_judged(self, prompts, prompt_mask, host: HostColumns):
        """(B×R float32 token scores, metrics with `reward/genrm_*`) from the judge, on the
        decoded prompts and responses; an unparseable verdict follows `reward_model.on_error`.
        Blocks this thread for the judge's generation (inside the `reward` stage's time)."""
        if self.model_client is not None:
            self.model_client.reset_counters()
        start = time.perf_counter()
        ids = [p[m] for p, m in zip(np.asarray(prompts), prompt_mask, strict=True)]
        texts = decode_responses(self.tokenizer, host.responses, host.valid_mask)
        outcomes = self.judge(self.tokenizer.batch_decode(ids), texts, list(host.ground_truth))
        # the judge's whole time; `timing_s/reward` shows the part no other stage overlapped
        spent = {"reward/genrm_time_s": time.perf_counter() - start}
        return self._placed(outcomes, host, judge_metrics(outcomes) | spent)

    def _placed(self, outcomes: list[Outcome], host: HostColumns, metrics: dict[str, float]):
        """Outcomes → (B×R float32 scores on each last token, metrics); applies `on_error`."""
        first = self._model_batches == 0
        self._model_batches += 1
        checked = check_outcomes(outcomes, host.data_source, self.manager.config.on_error, first)
        scores = np.array([o.score if o.kind == "ok" else 0.0 for o in outcomes], np.float32)
        width = host.responses.shape[1]
        served = self.model_client.metrics() if self.model_client is not None else {}
        return place_scores(scores, host.response_lengths, width), checked | metrics | served

    def collect(self, pending: PendingScores) -> tuple[jax.Array, RewardResult]:
        """(token_level_scores B×R float32 in `sharding`, the rule's result, whose metrics
        include the served model's, and `perf/transfer_bytes` for a reward model on its own
        pool: its inputs there and its scores back). Waits for both."""
        result = collect_rewards(pending.rule)
        rule_scores = lambda: put_global(result.token_level_scores, self.sharding)
        if pending.model is None:
            return rule_scores(), result
        if isinstance(pending.model, concurrent.futures.Future):
            host_scores, metrics = pending.model.result()
            model = put_global(host_scores, self.sharding)
            result = dataclasses.replace(result, metrics=_merge(result.metrics, metrics))
        elif self.model_sharding is not None:  # back from the reward model's pool
            model, back = move_rows(pending.model, self.sharding)
            moved = {"perf/transfer_bytes": float(pending.transfer_bytes + back)}
            result = dataclasses.replace(result, metrics=_merge(result.metrics, moved))
        else:
            model = pending.model
        scores = model + rule_scores() if self.combine == "sum" else model
        return jax.block_until_ready(scores), result

    def baselines(self, pending: PendingScores, n: int) -> jax.Array:
        """ReMax's `reward_baselines` (B·n,) float32: the score of each prompt's greedy response
        (`pending` scores B greedy responses), repeated for the prompt's n samples."""
        token_scores, _ = self.collect(pending)
        scores_B = jnp.sum(token_scores, axis=-1)
        return jax.device_put(jnp.repeat(scores_B, n), self.sharding)

    def close(self) -> None:
        self.manager.close()
        self._posts.shutdown(wait=False, cancel_futures=True)
        self._watch.shutdown(wait=False, cancel_futures=True)
        if self.model_client is not None:
            self.model_client.close()


def _merge(rule: dict[str, float], model: dict[str, float]) -> dict[str, float]:
    """Counts add up; the latency is the slower of the two (the one the stage waits for)."""
    out = dict(rule)
    for key, value in model.items():
        if key == "reward/remote_latency_ms":
            out[key] = max(out.get(key, 0.0), value)
        else:
            out[key] = out.get(key, 0.0) + value
    return out


def _model_data_parallel(model_sharding: NamedSharding | None, data_parallel: int) -> int:
    """Batch shards of the reward model's pool (data × expert × fsdp), or `data_parallel` when
    it shares the actor's."""
    if model_sharding is None:
        return data_parallel
    return batch_shards(model_sharding.mesh.shape)
