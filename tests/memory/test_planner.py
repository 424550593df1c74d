"""The memory planner: resident states from shard shapes (hand-computed), the KV pool, the
verdict and advice, and `trainer.check_memory` in the config check."""

import dataclasses
import pathlib

import jax
import jax.numpy as jnp
import pytest

import hybridjax
from configs.tiny import get_config
from hybridjax.config.checks import ConfigError
from hybridjax.config.run import resolve_dtypes
from hybridjax.memory import planner as plan
from hybridjax.memory.resident import kv_pool
from hybridjax.rl.checks import validate
from hybridjax.rl.step import default_pipeline
from hybridjax.sharding import MeshConfig, make_meshes
from hybridjax.training import build

F32 = 4
QUICKSTART_DATA = str(
    pathlib.Path(hybridjax.__file__).parent / "assets" / "quickstart" / "data" / "train.parquet"
)


def _grpo(devices: int, fsdp: int = 1, num_pages: int = 10):
    c = get_config()
    c.critic.enable = False
    c.algorithm.adv_estimator = "grpo"
    c.actor_rollout_ref.rollout.n = 2
    c.data.train_batch_size = c.actor_rollout_ref.actor.ppo_mini_batch_size = 4
    c.data.max_prompt_length = c.actor_rollout_ref.rollout.prompt_length = 16
    c.data.max_response_length = c.actor_rollout_ref.rollout.response_length = 8
    c.actor_rollout_ref.rollout.num_pages = num_pages
    c.actor_rollout_ref.rollout.page_size = 4
    c.mesh.train.data, c.mesh.train.fsdp = devices // fsdp, fsdp
    return c


@pytest.fixture(scope="module")
def tiny():
    c = _grpo(2)
    actor = build.actor_model_config(c, build.load_tokenizer(c))
    return c, actor, plan.plan_memory(c, actor, 2, capacity_bytes=10**9, target="cpu")


def test_resident_states_are_the_shard_bytes(tiny):
    c, actor, p = tiny
    stages = {s.name: s.consumers for s in p.stages}
    gen, update = stages["gen"], stages["update_actor"]
    params = actor.num_params() * F32  # replicated over data=2
    assert update["actor params"] == params
    # AdamW's two moments, plus a few scalars (step count, injected learning rate)
    assert 2 * params <= update["actor optimizer state"] <= 2 * params + 64
    assert gen["rollout weights"] == params  # float32 rollout, tensor=1
    # KV pool: 10 pages × 2 (k, v) × 2 layers × 2 kv heads × page 4 × head_dim 16 × 4 bytes
    assert p.kv_page_bytes == 2 * 2 * 2 * 4 * 16 * F32 and gen["KV pool"] == 10 * p.kv_page_bytes
    # the engine sleeps after gen (rollout.free_cache_engine): training holds neither
    assert "rollout weights" not in update and "KV pool" not in update
    # live bytes counted from shapes (tests/memory/test_counts.py): AdamW's moments are
    # two parameter-sized buffers, so the gradients (accumulator + one micro-batch's) are too
    assert update["update_actor gradients"] == update["actor optimizer state"]
    assert update["update_actor logits"] > 0 and update["update_actor activations"] > 0
    assert p.xla_cpu_scratch["update_actor"] > 0  # XLA's CPU figure, kept as a reference
    # on-policy GRPO without a KL term: no old_log_prob or ref pass to plan
    assert [s.name for s in p.stages] == ["gen", "update_actor", "reshard"]
    # re-layout writes the one new copy of the rollout weights into the sleeping engine
    assert stages["reshard"]["new rollout weights"] == params
    assert "rollout weights" not in stages["reshard"]


def test_the_plan_has_the_steps_device_stages_in_its_order(tiny):
    c, actor, _ = tiny
    c = c.copy_and_resolve_references()
    c.algorithm.adv_estimator, c.critic.enable = "gae", True
    c.actor_rollout_ref.actor.use_kl_loss = True
    c.actor_rollout_ref.actor.ppo_mini_batch_size = 2  # two mini-batches: old_log_prob runs
    p = plan.plan_memory(c, actor, 2, capacity_bytes=10**9, target="cpu", compile_stages=False)
    unplanned = {"sleep", "reward", "filter_groups", "adv", "onload"}  # reward: with a model
    expected = [name for name in default_pipeline(c).names if name not in unplanned]
    assert [s.name for s in p.stages] == expected
    assert expected == ["gen", "old_log_prob", "ref", "values", "update_critic", "update_actor",
                        "reshard"]  # fmt: skip


def test_a_kept_engine_holds_its_pool_and_two_copies_in_reshard(tiny):
    c, actor, _ = tiny
    c = c.copy_and_resolve_references()
    c.actor_rollout_ref.rollout.free_cache_engine = False
    p = plan.plan_memory(c, actor, 2, capacity_bytes=10**9, target="cpu", compile_stages=False)
    stages = {s.name: s.consumers for s in p.stages}
    assert stages["update_actor"]["KV pool"] == stages["gen"]["KV pool"] > 0
    assert stages["reshard"]["rollout weights"] == stages["reshard"]["new rollout weights"]


def test_frozen_reference_in_bfloat16_halves_its_bytes(tiny):
    c, actor, p = tiny
    c = c.copy_and_resolve_references()
    c.actor_rollout_ref.actor.use_kl_loss = True
    c.actor_rollout_ref.ref.fsdp_config.model_dtype = "bfloat16"
    half = plan.plan_memory(c, actor, 2, capacity_bytes=10**9, target="cpu", compile_stages=False)
    update = {s.name: s.consumers for s in half.stages}["update_actor"]
    assert 2 * update["ref params"] == update["actor params"]


def test_teacher_offload_frees_its_params_during_generation(tiny):
    """A distillation teacher of the actor's shape holds its parameters in every stage, and
    with `teacher_model.fsdp_config.param_offload` only in its own (`teacher`)."""
    c, actor, _ = tiny
    c = c.copy_and_resolve_references()
    c.actor_rollout_ref.distillation.enabled = True
    both = {}
    for offload in (False, True):
        c.actor_rollout_ref.distillation.teacher_model.fsdp_config.param_offload = offload
        p = plan.plan_memory(c, actor, 2, capacity_bytes=10**9, target="cpu", compile_stages=False)
        both[offload] = {s.name: s.consumers for s in p.stages}
    on, off = both[False], both[True]
    assert on["gen"]["teacher params"] == on["update_actor"]["actor params"]
    assert [name for name, s in off.items() if "teacher params" in s] == ["teacher"]
    assert off["teacher"]["teacher params"] == on["gen"]["teacher params"]


def test_fsdp_splits_the_states(tiny):
    c, actor, replicated = tiny
    c = _grpo(2, fsdp=2)
    split = plan.plan_memory(c, actor, 2, capacity_bytes=10**9, target="cpu")
    get = lambda p: {s.name: s for s in p.stages}["update_actor"].consumers["actor params"]
    # every weight has one dimension divisible by 2 except the norms (d = 64 floats each)
    norms = (2 * actor.num_hidden_layers + 1) * actor.hidden_size * F32
    assert get(split) == (get(replicated) - norms) // 2 + norms
    # AdamW's moments are split as the weights are (XLA alone would replicate the zeros)
    moments = {s.name: s for s in split.stages}["update_actor"].consumers["actor optimizer state"]
    assert 2 * get(split) <= moments <= 2 * get(split) + 64


def test_verdict_and_advice_follow_the_capacity(tiny):
    c, actor, p = tiny
    assert p.fits and p.worst.peak <= p.capacity
    small = dataclasses.replace(p, capacity=p.worst.peak - 1)
    assert not small.fits
    meshes = make_meshes(MeshConfig.from_config(c), jax.devices()[:2])
    advice = plan.advise(small, c, meshes.train, 2)
    worst = p.worst.name  # the stage with the highest peak, whichever it is
    assert any(f"short in {worst}" in a for a in advice)
    report = small.report()
    assert "does NOT fit" in report and f"largest consumers in {worst}" in report
    # the pool holds 10 pages = 1 full sequence of 16 + 8 tokens (6 pages), below max_num_seqs
    assert p.full_sequences == 1 and any("max_num_seqs" in a for a in p.advice)
    assert any("preempted and recomputed" in a for a in p.advice)  # pages on demand


def test_too_many_devices_points_to_the_cli(tiny):
    c, actor, _ = tiny
    with pytest.raises(ValueError, match="python -m hybridjax.plan --devices=64"):
        plan.plan_memory(c, actor, 64)


def test_check_memory_is_a_config_problem_when_the_plan_does_not_fit(tiny, monkeypatch):
    c, actor, p = tiny
    c.trainer.check_memory = True
    c.data.train_files = c.data.val_files = QUICKSTART_DATA
    configs = {"actor_rollout_ref.model": actor}
    monkeypatch.setattr(plan, "device_capacity", lambda device, local: p.worst.peak * 4)
    validate(c, 2, configs)  # fits: no problem
    monkeypatch.setattr(plan, "device_capacity", lambda device, local: p.worst.peak // 2)
    with pytest.raises(ConfigError, match=f"trainer.check_memory: {p.worst.name} needs"):
        validate(c, 2, configs)


QWEN3_30B_A3B = str(pathlib.Path(__file__).parents[2] / "configs" / "models" / "qwen3-30b-a3b")


def test_expert_parallelism_stores_and_gathers_experts_per_expert_shard():
    """Qwen3-30B-A3B's shapes (2 of its layers) on 8 devices, counted from shapes. mesh.train
    fsdp 8 splits every weight 8 ways; expert 4 × fsdp 2 still splits the 128 experts (and the
    routers) 8 ways but the other weights only 2. An update gathers (over fsdp) a layer's
    experts of its own expert shard, 32 of 128, and runs them over the 4× tokens gathered from
    its expert group. The LM head is unfused here, gathered whole under both meshes, so that
    only the experts differ (the vocab-parallel head would count at 1/8 against 1/2)."""
    c = _grpo(8, fsdp=8)
    c.actor_rollout_ref.model.use_fused_kernels = False
    c.actor_rollout_ref.model.path = QWEN3_30B_A3B
    c.actor_rollout_ref.model.override_config = dict(num_hidden_layers=2)  # 2 of its 48 layers
    c.data.train_batch_size = c.actor_rollout_ref.actor.ppo_mini_batch_size = 8
    actor = build.actor_model_config(c, tokenizer=None)
    fsdp = plan.plan_memory(c, actor, 8, 10**12, target="gpu", compile_stages=False)
    c.mesh.train.update(dict(data=1, expert=4, fsdp=2))
    ep = plan.plan_memory(c, actor, 8, 10**12, target="gpu", compile_stages=False)

    e, d, f, layers = 128, actor.hidden_size, actor.moe_intermediate_size, 2
    assert (actor.num_experts, d, f) == (e, 2048, 768)
    p, cb = jnp.dtype(actor.param_dtype).itemsize, jnp.dtype(actor.dtype).itemsize
    layer_experts = (3 * e * d * f + e * d) * p  # experts and router of one layer
    params = {n: x.stages[-1].consumers["actor params"] for n, x in (("fsdp", fsdp), ("ep", ep))}
    norms = (2 * layers + 1) * d * p + layers * 2 * actor.resolved_head_dim * p  # replicated
    rest = params["fsdp"] - layers * layer_experts // 8 - norms  # other weights, split 8 ways
    assert params["ep"] == layers * layer_experts // 8 + 4 * rest + norms

    def update(x):
        return next(s for s in x.stages if s.name == "update_actor").consumers

    cast = actor.dtype != actor.param_dtype
    per_weight_byte = (1 + cast * cb / p) + (cast * cb / p + F32 / p)  # gathered, update
    gathered = "update_actor gathered weights"
    saved = update(fsdp)[gathered] - update(ep)[gathered]
    assert saved == pytest.approx(layer_experts * 3 / 4 * per_weight_byte, rel=1e-6)
    activations = "update_actor activations"
    assert update(ep)[activations] > update(fsdp)[activations]


def _planned(c, actor):
    p = plan.plan_memory(c, actor, 2, capacity_bytes=10**9, target="cpu", compile_stages=False)
    return {s.name: s.consumers for s in p.stages}


def test_a_reward_model_and_a_teacher_get_stages_of_their_own(tiny, tmp_path):
    """A classifier reward model is planned as `score_responses` on the training mesh, a
    distillation teacher as the reference's forward with its own weights (twice the layers)."""
    from flax import nnx

    from hybridjax.models.decoder import SequenceClassifier
    from hybridjax.models.hf_io import save_pretrained

    c, actor, _ = tiny
    c = c.copy_and_resolve_references()
    save_pretrained(
        SequenceClassifier(dataclasses.replace(actor, num_labels=1), nnx.Rngs(1)), tmp_path
    )
    c.reward_model.enable, c.reward_model.model.path = True, str(tmp_path)
    d = c.actor_rollout_ref.distillation
    d.enabled, d.teacher_model.override_config = True, {"num_hidden_layers": 4}
    stages = _planned(c, actor)
    assert list(stages)[:3] == ["gen", "reward", "old_log_prob"]
    assert list(stages)[3] == "teacher"  # after ref (none here: no KL term)
    assert actor.tie_word_embeddings  # V×D counted once; a final norm of D
    per_layer = (actor.num_params() - actor.vocab_size * actor.hidden_size - actor.hidden_size) // 2
    rm = actor.num_params() + actor.hidden_size  # the same trunk and a 1-label score head
    assert stages["reward"]["reward model params"] == rm * F32  # replicated over data=2
    assert stages["reward"]["reward activations"] > 0
    assert stages["teacher"]["teacher params"] == (actor.num_params() + 2 * per_layer) * F32
    assert (
        stages["teacher"]["teacher activations"]
        > stages["old_log_prob"]["old_log_prob activations"]
    )
    # resident through every stage (no offload asked)
    assert stages["update_actor"]["reward model params"] == rm * F32


@pytest.mark.parametrize("free", [True, False])
def test_a_judge_holds_its_kv_pool_only_while_it_judges(tiny, free):
    """A generative reward model: its weights (generation layout, tensor 1) stay; its KV pool
    (CPU target: `max_num_seqs` full judge sequences) is on the devices in `reward` only, unless
    `generative.free_cache_engine` is off."""
    from hybridjax.rewards import genrm
    from tests.rewards import judge_testing as jt

    c, actor, _ = tiny
    c = c.copy_and_resolve_references()
    g = c.reward_model.generative
    g.enable, g.free_cache_engine, g.max_num_seqs = True, free, 3
    g.prompt_length, g.response_length = 44, 4
    c.reward_model.enable = True
    c.reward_model.model.path = jt.save_judge(str(pytest.importorskip("tempfile").mkdtemp()))
    stages = _planned(c, actor)
    judge = jt.make_judge().config
    assert stages["reward"]["judge params"] == judge.num_params() * F32
    # 3 slots × 48 tokens = 9 pages of 16: 2 (k, v) × 1 layer × 1 kv head × 16 × head_dim 4
    page = 2 * 1 * 1 * 16 * 4 * F32
    assert genrm.judge_engine_config(g).default_num_pages == 9
    assert stages["reward"]["judge KV pool"] == 9 * page
    assert any(k.startswith("reward decode scratch") for k in stages["reward"])
    for name in ("gen", "update_actor", "reshard"):
        assert stages[name]["judge params"] == judge.num_params() * F32
        assert ("judge KV pool" in stages[name]) is not free


def test_offloaded_states_count_only_in_the_stages_that_use_them(tiny):
    """`fsdp_config.*_offload` (`hybridjax.training.offload`): the reference only in `ref`, the
    actor's optimizer state only in `update_actor`, as the step places them."""
    c, actor, _ = tiny
    c = c.copy_and_resolve_references()
    c.actor_rollout_ref.actor.use_kl_loss = True
    c.actor_rollout_ref.ref.fsdp_config.param_offload = True
    c.actor_rollout_ref.actor.fsdp_config.optimizer_offload = True
    stages = _planned(c, actor)
    assert [n for n, s in stages.items() if "ref params" in s] == ["ref"]
    assert [n for n, s in stages.items() if "actor optimizer state" in s] == ["update_actor"]
    assert [n for n, s in stages.items() if "actor params" in s] == list(stages)  # not offloaded


def test_routing_replay_stages_compile_with_the_recorded_experts():
    """R3 on a tiny MoE actor: the planner's old_log_prob and update batches carry the
    rollout's `routed_experts` (B×(P+R)×L×k int32), which both passes require and replay, so
    their programs compile and read it (the update's inputs grow by its bytes)."""
    c = _grpo(2)
    c.actor_rollout_ref.model.use_remove_padding = False
    c.actor_rollout_ref.actor.recompute_old_log_prob = "true"
    c.actor_rollout_ref.model.override_config.update(
        dict(family="qwen3_moe", attention_bias=False, num_experts=4, num_experts_per_tok=2,
             moe_intermediate_size=16, mlp_only_layers=(1,))
    )  # fmt: skip
    actor = build.actor_model_config(c, build.load_tokenizer(c))
    plans = {}
    for mode, record in (("disabled", False), ("R3", True)):
        c.actor_rollout_ref.actor.router_replay.mode = mode
        c.actor_rollout_ref.rollout.enable_rollout_routing_replay = record
        plans[mode] = plan.plan_memory(c, actor, 2, capacity_bytes=10**9, target="cpu")
    names = {s.name for s in plans["R3"].stages}
    assert {"old_log_prob", "update_actor"} <= names
    layers = sum(map(actor.is_moe_layer, range(actor.num_hidden_layers)))
    routed = 8 * (16 + 8) * layers * 2 * 4 // 2  # rows × tokens × L × k int32, over 2 shards
    update = {p: next(s for s in plans[p].stages if s.name == "update_actor") for p in plans}
    grown = update["R3"].peak - update["disabled"].peak
    assert grown >= routed, (grown, routed)


def _gpu_plan(**dtypes):
    c = _grpo(2)
    c.update_from_flattened_dict(dtypes)
    c.actor_rollout_ref.actor.use_kl_loss = True  # a reference, in its own dtype
    resolve_dtypes(c, "gpu")  # as `python -m hybridjax.plan --target=gpu` does
    actor = build.actor_model_config(c, build.load_tokenizer(c))
    return plan.plan_memory(c, actor, 2, 10**9, target="gpu", compile_stages=False).to_dict()


def test_auto_dtypes_plan_a_gpu_run_in_bfloat16():
    """Planned from this CPU for GPUs, `auto` (the default of model.dtype and rollout.dtype)
    counts as bfloat16, not as the host's float32."""
    ref = "actor_rollout_ref.ref.fsdp_config.model_dtype"
    auto = _gpu_plan(**{ref: "auto"})
    keys = ["actor_rollout_ref.model.dtype", "actor_rollout_ref.rollout.dtype", ref]
    assert auto == _gpu_plan(**dict.fromkeys(keys, "bfloat16"))
    f32 = _gpu_plan(**dict.fromkeys(keys, "float32"))
    gen, gen32 = auto["stages"]["gen"], f32["stages"]["gen"]
    assert 2 * gen["rollout weights"] == gen32["rollout weights"]
    assert 2 * gen["ref params"] == gen32["ref params"]
    assert 2 * auto["kv_page_bytes"] == f32["kv_page_bytes"]  # the pool in the compute dtype


@pytest.mark.parametrize("scan_layers", [False, True])
@pytest.mark.parametrize("tp", [1, 2])
def test_kv_page_bytes_are_what_the_engine_allocates(scan_layers, tp):
    """Per-layer or stacked (a `scan_layers` model) pools: the planner's pages × page bytes
    per device are the bytes of `PagedKVCache.create_pool`'s arrays over the tensor-parallel
    devices."""
    from hybridjax.models.config import ModelConfig, to_dtype
    from hybridjax.rollout import RolloutConfig
    from hybridjax.rollout.paged_cache import PagedKVCache

    model = ModelConfig(
        vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, scan_layers=scan_layers,
    )  # fmt: skip
    r = RolloutConfig(page_size=4, num_pages=10, max_num_seqs=2, prompt_length=8, response_length=8)
    pages, page = kv_pool(r, model, tp, 10**9, 0, stats=False)
    pools = jax.eval_shape(
        lambda: PagedKVCache.create_pool(model, pages, r.page_size, to_dtype(model.dtype))
    )
    leaves = jax.tree.leaves(pools)
    assert len(leaves) == (2 if scan_layers else 6)
    assert sum(x.size * x.dtype.itemsize for x in leaves) == tp * pages * page
