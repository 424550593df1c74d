"""The generative reward model (`hybridjax.rewards.genrm`): verdict parsers, the template and
parse path on a stubbed generate, the paged engine on a tiny judge whose verdicts are known, the
judge server against the local judge, and a GRPO step judged by it."""

from __future__ import annotations

import math

import jax
import numpy as np
import pytest

from hybridjax.rewards import genrm
from hybridjax.rewards.manager import RewardFunctionError, check_outcomes
from hybridjax.rewards.remote import RemoteClient, RemoteConfig
from hybridjax.rewards.serve import ServedJudge, create_app
from tests.http_testing import serve
from tests.rewards import judge_testing as jt

BLOCK = dict(prompt_template=jt.TEMPLATE, max_score=10.0, response_length=4, prompt_length=64,
             max_num_seqs=4)  # fmt: skip
PROMPTS = ["2+2", "3+3", "what?", "1+1"]
RESPONSES = ["four!", "six?", "ok", "two !"]


@pytest.mark.parametrize(
    "name, verdict, score",
    [
        ("number", "The answer is fine. Score: 7", 7.0),
        ("number", "0.5", 0.5),
        ("yes_no", " Yes, it is correct", 10.0),
        ("yes_no", "no.", 0.0),
        ("boxed", "I give it \\boxed{3} (was \\boxed{9}) \\boxed{ 4.5 }", 4.5),
    ],
)
def test_parsers_read_the_score(name, verdict, score):
    assert genrm.VERDICT_PARSERS.get(name)(verdict, 0.0, 10.0) == score


@pytest.mark.parametrize(
    "name, verdict",
    [("number", "no idea"), ("number", "11"), ("yes_no", "maybe yes"), ("boxed", "7")],
)
def test_parsers_refuse_what_they_cannot_read(name, verdict):
    with pytest.raises(ValueError):
        genrm.VERDICT_PARSERS.get(name)(verdict, 0.0, 10.0)


def test_config_errors_name_the_key():
    with pytest.raises(ValueError, match="parser='nope'.*boxed"):
        genrm.JudgeConfig(parser="nope")
    with pytest.raises(ValueError, match=r"prompt_template.*\['question'\]"):
        genrm.JudgeConfig(prompt_template="{question} {response}")
    with pytest.raises(ValueError, match="register"):
        genrm.register_parser("number")(lambda v, lo, hi: 0.0)


def test_template_and_parse_on_a_stubbed_generate(tmp_path):
    """The judge sees the filled template (judge tokenizer), its verdict text is parsed; a
    custom parser by path; an unreadable verdict is an error outcome with its text."""
    tok = jt.tokenizer()
    seen = []

    def generate(prefixes, rests):
        seen.extend(tok.decode(p + r) for p, r in zip(prefixes, rests, strict=True))
        return [tok.encode(v) for v in ("Score: 7", "3.5", "none")]

    template = "Q: {prompt} A: {response} truth={ground_truth}"
    judge = genrm.Judge(genrm.JudgeConfig(prompt_template=template, max_score=10), tok, generate)
    out = judge.score(["1+1", "2+2", "x"], ["2", "4", "y"], ["2", None, 5])
    assert seen == ["Q: 1+1 A: 2 truth=2", "Q: 2+2 A: 4 truth=", "Q: x A: y truth=5"]
    assert [o.kind for o in out] == ["ok", "ok", "error"]
    assert [o.score for o in out[:2]] == [7.0, 3.5]
    assert "unparseable verdict" in out[2].error and "'none'" in out[2].error
    assert out[0].extras["genrm_verdict_tokens"] == len(tok.encode("Score: 7"))
    metrics = genrm.judge_metrics(out)
    assert metrics["reward/genrm_parse_failures"] == 1
    assert metrics["reward/genrm_score_mean"] == pytest.approx(5.25)

    seen.clear()
    short = genrm.Judge(genrm.JudgeConfig(prompt_template=template, max_score=10), tok, generate,
                        max_prompt_tokens=len(tok.encode("Q: 1+1 A: 2 truth=2")))  # fmt: skip
    out = short.score(["1+1", "2+2 is a longer question", "x"], ["2", "4", "y"], ["2", None, 5])
    assert len(seen) == 2 and [o.kind for o in out] == ["ok", "error", "ok"]
    assert "> prompt_length" in out[1].error and out[2].score == 3.5

    (tmp_path / "parse.py").write_text("def parse_verdict(v):\n    return len(v) / 10\n")
    custom = genrm.JudgeConfig(parser_path=str(tmp_path / "parse.py"))
    out = genrm.Judge(custom, tok, generate).score(["a"] * 3, ["b"] * 3)
    assert [o.score for o in out] == [0.8, 0.3, 0.4]


@pytest.fixture(scope="module")
def judge_dir(tmp_path_factory):
    return jt.save_judge(str(tmp_path_factory.mktemp("judge")))


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    from tests.rl.tiny_run import gsm8k_subset

    return gsm8k_subset(tmp_path_factory.mktemp("gsm8k"), train_rows=16, test_rows=8)


@pytest.fixture(scope="module")
def local_judge(judge_dir):
    config = genrm.JudgeConfig.from_dict(BLOCK)
    return genrm.load_judge(judge_dir, config, genrm.judge_engine_config(BLOCK))


def test_engine_judge_scores_equal_the_known_verdicts(local_judge):
    """Greedy decoding of the tiny judge on the paged engine: `!` → 9, `?` → x (unparseable,
    an error that `on_error` handles), anything else → 2; one token each."""
    out = local_judge.score(PROMPTS, RESPONSES)
    expected = [jt.expected_verdict(r) for r in RESPONSES]
    assert expected == ["9", "x", "2", "9"]
    assert [o.kind for o in out] == ["ok", "error", "ok", "ok"]
    assert [o.score for o in out if o.kind == "ok"] == [9.0, 2.0, 9.0]
    assert all(o.extras["genrm_verdict_tokens"] == 1 for o in out)
    metrics = genrm.judge_metrics(out)
    assert metrics["reward/genrm_score_mean"] == pytest.approx(20 / 3)
    assert metrics["reward/genrm_parse_failures"] == 1
    # on_error: zero scores the row 0 (and counts it), raise stops
    counts = check_outcomes(out, ["gsm8k"] * 4, "zero", first_batch=True)
    assert counts["reward/num_errors"] == 1
    with pytest.raises(RewardFunctionError, match="unparseable verdict"):
        check_outcomes(out, ["gsm8k"] * 4, "raise", first_batch=False)


def test_the_judge_engine_holds_its_pool_only_while_it_judges(local_judge):
    """`generative.free_cache_engine` (default on): the judge's KV pool is deleted from the
    devices (the buffers, not only the references) after every batch, and the next batch
    rebuilds it with the same verdicts; off, it stays."""
    judge = local_judge.generate
    assert judge.engine.asleep  # from the start
    judge.engine.wake_up()
    pools = jax.tree.leaves((judge.engine.k_pools, judge.engine.v_pools))
    before = judge.released_bytes
    first = [o.score for o in local_judge.score(PROMPTS, RESPONSES)]
    assert judge.engine.asleep and all(x.is_deleted() for x in pools)
    once = judge.released_bytes - before
    assert once == sum(x.nbytes for x in pools) > 0
    assert [o.score for o in local_judge.score(PROMPTS, RESPONSES)] == first
    assert judge.released_bytes - before == 2 * once
    judge.free_cache_engine = False
    try:
        local_judge.score(PROMPTS, RESPONSES)
        assert not judge.engine.asleep
    finally:
        judge.free_cache_engine = True
        judge.released_bytes += judge.engine.sleep(1)


def test_served_judge_equals_the_local_one(judge_dir, local_judge):
    """`POST /judge` of `hybridjax.rewards.serve` through the trainer's client: the same
    outcomes and metrics as the local judge."""
    app = create_app(judge=ServedJudge(judge_dir, BLOCK))
    for url in serve(app):
        client = RemoteClient(RemoteConfig(urls=(url,), batch_size=3), "judge")
        served = client.judge(PROMPTS, RESPONSES)
        client.close()
    local = local_judge.score(PROMPTS, RESPONSES)
    assert [(o.kind, o.score) for o in served] == [(o.kind, o.score) for o in local]
    assert genrm.judge_metrics(served) == genrm.judge_metrics(local)


@pytest.mark.slow
@pytest.mark.parametrize("pool", ["rollout", "reward_pool", "served"])
def test_grpo_step_judged_by_the_generative_reward_model(pool, judge_dir, data, tmp_path_factory):
    """One GRPO step on the tiny config with the judge as the only reward, co-located on the
    rollout's devices, on a pool of its own (`placement.reward_model`), or served by
    `hybridjax.rewards.serve` (`reward_model.remote.urls`, no `model.path`): every row's score
    is a verdict of the judge (2 or 9, 0 when it wrote `x`) and its metrics are reported."""
    from hybridjax.rl.trainer import RLTrainer
    from tests.rl.tiny_run import read_metrics, tiny_config

    run = tmp_path_factory.mktemp("run")
    changes = {f"reward_model.generative.{k}": v for k, v in BLOCK.items()}
    changes |= {
        "algorithm.adv_estimator": "grpo",
        "critic.enable": False,
        "actor_rollout_ref.rollout.n": 2,
        "trainer.total_training_steps": 1,
        "trainer.test_freq": -1,
        "trainer.val_before_train": False,
        "trainer.save_freq": -1,
        "reward_model.enable": True,
        "reward_model.model.path": judge_dir,
        "reward_model.generative.enable": True,
        "reward_model.generative.prompt_length": 256,
    }
    config = tiny_config(data, run, **changes)
    if pool == "reward_pool":
        config.resource_pool = dict(
            global_pool=dict(n_devices=4),
            reward_pool=dict(n_devices=2),
            rollout_pool=dict(n_devices=2),
        )  # devices in name order: 0-3, 4-5, 6-7
        config.placement.update(dict(rollout="rollout_pool", reward_model="reward_pool"))
    if pool == "served":
        block = BLOCK | {"prompt_length": 256}
        server = serve(create_app(judge=ServedJudge(judge_dir, block)))
        config.reward_model.model.path, config.reward_model.remote.urls = "", next(server)
    trainer = RLTrainer(config)
    assert trainer.models.reward_model is None  # no classifier: the judge scores
    if pool == "served":
        assert trainer.reward.model_client.kind == "judge"
    else:
        engine = trainer.reward.judge.__self__.generate.engine
        judge_devices = {d.id for d in engine.mesh.devices.flat}
        rollout_devices = {d.id for d in trainer.meshes.generate.devices.flat}
        assert judge_devices == (rollout_devices if pool == "rollout" else {4, 5})
    trainer.fit()
    trainer.close()
    if pool == "served":
        next(server, None)  # stops the server
    m = read_metrics(run)[1]
    assert all(math.isfinite(v) for v in m.values())
    assert m["reward/genrm_prompt_tokens"] > 0 and m["reward/genrm_verdict_tokens"] == 1
    assert 2.0 <= m["reward/genrm_score_mean"] <= 9.0
    assert m["reward/num_errors"] == m["reward/genrm_parse_failures"]
    assert m["critic/score/max"] <= 9 and m["critic/score/min"] >= 0
    assert m["timing_s/reward"] > 0 and m["reward/genrm_time_s"] > 0


def test_template_fields():
    assert genrm.unknown_fields("\\boxed{{score}} {prompt} {response}") == []
    assert genrm.unknown_fields("{prompt} {answer}") == ["answer"]
    assert genrm.unknown_fields("{prompt") == [
        "(malformed template: expected '}' before end of string)"
    ]


def _host_columns(responses: list[list[int]], width: int = 8):
    from hybridjax.rl.generation import HostColumns

    ids = np.zeros((len(responses), width), np.int32)
    mask = np.zeros_like(ids)
    for i, r in enumerate(responses):
        ids[i, : len(r)], mask[i, : len(r)] = r, 1
    n = len(responses)
    lengths = mask.sum(1)
    return HostColumns(["gsm8k"] * n, ["4"] * n, [{}] * n, np.ones(n, bool), lengths * 0 + 3,
                       lengths, ids, mask)  # fmt: skip


def test_reward_stage_scores_the_verdicts_locally_and_served(judge_dir, local_judge):
    """The reward stage with the judge: the token scores are the parsed verdicts on each last
    response token, the unparseable one scored 0 by `on_error=zero`; a judge server configured
    through `reward_model.remote.urls` gives the same scores and `reward/genrm_*` metrics."""
    import jax
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    from hybridjax.config.schema import base_config
    from hybridjax.rewards import RewardConfig, RewardManager
    from hybridjax.rl.reward import RewardStage

    tok = jt.tokenizer()
    prompts = np.array([[0, 0] + tok.encode(p)[-3:] for p in ["2+2", "3+3", "what?", "1+1"]])
    prompt_mask = np.ones(prompts.shape, bool)
    prompt_mask[:, :2] = False
    host = _host_columns([tok.encode(r) for r in RESPONSES])
    sharding = NamedSharding(Mesh(np.array(jax.devices()[:1]), ("data",)), PartitionSpec())
    local = RewardStage(RewardManager(RewardConfig()), tok, None, 1, sharding, 1,
                        judge=local_judge.score)  # fmt: skip
    scores, metrics = local._score_judged(prompts, prompt_mask, host)
    last = host.response_lengths - 1
    assert scores[np.arange(4), last].tolist() == [9.0, 0.0, 2.0, 9.0]
    assert scores.sum() == 20.0
    assert metrics["reward/num_errors"] == 1 and metrics["reward/genrm_parse_failures"] == 1
    local.close()

    cfg = base_config()
    cfg.reward_model.enable = True
    cfg.reward_model.generative.enable = True
    for url in serve(create_app(judge=ServedJudge(judge_dir, BLOCK))):
        cfg.reward_model.remote.urls = url
        served = RewardStage.from_config(cfg, tok, None, sharding, 1)
        assert served.model_client is not None and served.model_client.kind == "judge"
        served_scores, served_metrics = served._score_judged(prompts, prompt_mask, host)
        served.close()
    np.testing.assert_array_equal(served_scores, scores)
    for key in [k for k in metrics if k.startswith("reward/genrm_") and k != "reward/genrm_time_s"]:
        assert served_metrics[key] == metrics[key], key
    assert served_metrics["reward/remote_latency_ms"] > 0
