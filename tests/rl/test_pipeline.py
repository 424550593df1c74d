"""The pipeline of named stages: order, timers, deferred work, edits, checks, `trainer.stages`,
the default pipelines built from the config, and DAPO's group selection."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import SingleDeviceSharding

from hybridjax.config.checks import ConfigError
from hybridjax.config.schema import base_config
from hybridjax.rl import step
from hybridjax.rl.checks import validate
from hybridjax.rl.dynamic_sampling import _take, varied_groups
from hybridjax.rl.generation import HostColumns
from hybridjax.rl.pipeline import (
    Deferred,
    Pipeline,
    PipelineError,
    Stage,
    StepContext,
    apply_entries,
)
from hybridjax.training.batch import make_batch


def _batch(rows=4, uid=(0, 0, 1, 1)):
    ones = jnp.ones((rows, 2), jnp.int32)
    return make_batch(ones, ones, ones, ones.astype(jnp.float32), uid_B=jnp.asarray(uid))


def _toy_pipeline(events: list[str]) -> Pipeline:
    def gen(batch, ctx):
        events.append("gen")
        return _batch()

    def score(batch, ctx):
        events.append("score started")

        def finish(batch, ctx):
            events.append("score finished")
            return batch.replace(token_level_scores=jnp.ones((4, 2)))

        return Deferred(finish)

    def passes(batch, ctx):
        events.append("passes")
        return batch.replace(values=jnp.zeros((4, 2)))

    def adv(batch, ctx):
        events.append(f"adv sees {float(batch.token_level_scores.sum())}")
        ctx.metrics["adv/x"] = jnp.float32(1.0)
        return batch.replace(advantages=batch.token_level_scores)

    return Pipeline([
        Stage("gen", gen, writes=step.GENERATED[:-1]),
        Stage("reward", score, writes=("token_level_scores",)),
        Stage("values", passes, reads=("responses",), writes=("values",)),
        Stage("adv", adv, reads=("token_level_scores",), writes=("advantages",)),
    ])  # fmt: skip


def test_stages_run_in_order_timed_with_deferred_work_finished_before_its_reader():
    events = []
    ctx = StepContext(step=1)
    batch = _toy_pipeline(events).run(ctx)
    assert events == ["gen", "score started", "passes", "score finished", "adv sees 8.0"]
    assert set(ctx.timing) == {"gen", "reward", "values", "adv"}
    assert ctx.metrics == {"adv/x": 1.0}
    np.testing.assert_array_equal(batch.advantages, np.ones((4, 2)))


def test_deferred_work_nobody_reads_is_finished_at_the_end():
    events = []
    batch = _toy_pipeline(events).remove("adv").run(StepContext(step=1))
    assert events[-1] == "score finished" and batch.token_level_scores is not None


def test_edits_return_new_pipelines_and_name_unknown_stages():
    p = _toy_pipeline([])
    extra = Stage("extra", lambda b, ctx: b)
    assert p.insert_after("reward", extra).names == ("gen", "reward", "extra", "values", "adv")
    assert p.insert_before("gen", extra).names[0] == "extra"
    assert p.replace("values", extra).names == ("gen", "reward", "extra", "adv")
    assert p.remove("values").names == ("gen", "reward", "adv")
    assert p.names == ("gen", "reward", "values", "adv")  # unchanged
    with pytest.raises(PipelineError, match=r"no stage named 'rewards'; stages: gen → reward"):
        p.insert_after("rewards", extra)
    with pytest.raises(PipelineError, match="two stages are named 'gen'"):
        p.insert_after("adv", Stage("gen", lambda b, ctx: b))


def test_check_names_the_reader_the_field_and_its_writer():
    p = _toy_pipeline([])
    p.check()
    early = Stage("early", lambda b, ctx: b, reads=("advantages",))
    with pytest.raises(
        PipelineError, match="'early' reads batch field 'advantages', but only 'adv'"
    ):
        p.insert_after("gen", early).check()
    orphan = Stage("orphan", lambda b, ctx: b, reads=("ref_log_prob",))
    with pytest.raises(PipelineError, match="'ref_log_prob', but no stage writes it"):
        p.insert_after("adv", orphan).check()
    with pytest.raises(PipelineError, match=r"unknown batch fields \['scores'\]; valid: prompts"):
        Stage("typo", lambda b, ctx: b, reads=("scores",))


USER_FILE = """
from hybridjax.rl import stage

@stage(reads=("token_level_scores",), writes=("token_level_scores",))
def halve(batch, ctx):
    return batch.replace(token_level_scores=batch.token_level_scores / 2)

def plain(batch, ctx):
    return batch
"""


def test_trainer_stages_entries_load_user_files_and_modules(tmp_path):
    path = tmp_path / "user_stages.py"
    path.write_text(USER_FILE)
    p = apply_entries(_toy_pipeline([]), [
        f"after reward: {path}:halve",
        f"before gen:{path}:plain",
        "remove values",
    ])  # fmt: skip
    assert p.names == ("plain", "gen", "reward", "halve", "adv")
    ctx = StepContext(step=1)
    np.testing.assert_array_equal(p.run(ctx).advantages, np.full((4, 2), 0.5))
    assert "halve" in ctx.timing
    module = apply_entries(_toy_pipeline([]), ["replace values: hybridjax.rl.step:RESHARD"])
    assert module.names == ("gen", "reward", "reshard", "adv")

    problems = {
        "after reward halve": "cannot read 'after reward halve'",
        f"after reward: {tmp_path}/missing.py:halve": "is not a file or an importable module",
        f"after reward: {path}:nothing": "has no stage or function 'nothing'",
        f"before reward: {path}:halve": "'halve' reads batch field 'token_level_scores', but only",
        f"after rewards: {path}:halve": "no stage named 'rewards'",
    }
    for entry, message in problems.items():
        with pytest.raises(PipelineError, match=message):
            apply_entries(_toy_pipeline([]).remove("adv"), [entry])


def _config(**changes):
    c = base_config()
    c.update_from_flattened_dict(changes)
    return c


def test_default_pipelines_follow_the_config():
    ppo = _config(**{"critic.enable": True})
    assert str(step.default_pipeline(ppo)) == (
        "gen → sleep → reward → old_log_prob → values → adv → update_critic → update_actor → "
        "reshard"
    )
    grpo = _config(**{
        "algorithm.adv_estimator": "grpo",
        "actor_rollout_ref.actor.ppo_mini_batch_size": 1024,  # on-policy: no old_log_prob
        "actor_rollout_ref.actor.use_kl_loss": True,
        "actor_rollout_ref.actor.fsdp_config.optimizer_offload": True,
        "algorithm.filter_groups.enable": True,
    })  # fmt: skip
    assert str(step.default_pipeline(grpo)) == (
        "gen → reward → filter_groups → sleep → ref → adv → update_actor → reshard → onload"
    )
    kept = _config(**{"actor_rollout_ref.rollout.free_cache_engine": False})
    assert "sleep" not in step.default_pipeline(kept).names
    remax = step.default_pipeline(_config(**{"algorithm.adv_estimator": "remax"}))
    assert remax.stages[0] is step.GEN
    assert "reward_baselines" in remax.stages[2].writes  # after gen and sleep


def test_default_stages_stay_in_the_steps_order():
    dapo = step.default_pipeline(_config(**{"algorithm.filter_groups.enable": True}))
    assert step.check_order(dapo) is dapo  # sleep after filter_groups
    moved = step.default_pipeline(_config()).remove("reshard").insert_before("adv", step.RESHARD)
    with pytest.raises(PipelineError, match="the default stages run in the step's order"):
        step.check_order(moved)


def test_config_problems_name_their_keys(tmp_path):
    c = _config(**{
        "algorithm.filter_groups.enable": True,
        "algorithm.filter_groups.metric": "seq_final_reward",
        "algorithm.filter_groups.max_num_gen_batches": -1,
        "trainer.stages": ("after rewards: nowhere.py:f",),
    })  # fmt: skip
    problems = "\n".join(step.config_problems(c))
    assert "max_num_gen_batches: must be >= 0" in problems
    assert "metric: 'seq_final_reward'" in problems
    assert "'nowhere.py' is not a file or an importable module" in problems
    with pytest.raises(ConfigError, match="'nowhere.py' is not a file"):  # the start-up check
        validate(c, 1)


def test_varied_groups_keeps_spread_and_singletons():
    values = np.array([1.0, 1.0, 0.0, 1.0, 0.5, 0.0, 0.0])
    uid = np.array([3, 3, 0, 0, 5, 1, 1])  # all-equal 3 and 1, varied 0, singleton 5
    np.testing.assert_array_equal(varied_groups(values, uid), [0, 0, 1, 1, 1, 0, 0])


def test_take_keeps_the_first_groups_and_renumbers_their_uids():
    host = lambda rows: HostColumns(
        data_source=[f"s{i}" for i in range(rows)], ground_truth=list(range(rows)),
        extra_info=[None] * rows, row_mask=np.ones(rows, bool),
        prompt_lengths=np.arange(rows), response_lengths=np.arange(rows),
        responses=np.zeros((rows, 2), np.int32), response_mask=np.ones((rows, 2)),
    )  # fmt: skip
    first = _batch(4, (0, 0, 1, 1)).replace(token_level_scores=jnp.arange(8.0).reshape(4, 2))
    second = _batch(4, (1, 1, 0, 0)).replace(token_level_scores=-jnp.arange(8.0).reshape(4, 2))
    parts = [
        (first, host(4), np.array([False, False, True, True])),  # keeps group 1
        (second, host(4), np.array([True, True, True, True])),  # keeps groups 1 and 0
    ]
    sharding = SingleDeviceSharding(jax.devices()[0])
    batch, columns = _take(parts, 2, sharding)
    np.testing.assert_array_equal(batch.uid, [0, 0, 1, 1])
    np.testing.assert_array_equal(batch.token_level_scores[:, 0], [4, 6, -0, -2])
    assert columns.data_source == ["s2", "s3", "s0", "s1"]
    np.testing.assert_array_equal(columns.prompt_lengths, [2, 3, 0, 1])
    assert batch.advantages is None
