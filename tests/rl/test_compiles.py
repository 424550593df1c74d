"""No program compiles after warm-up: once the first step and the first validation have run,
every later step and validation reuses compiled programs, in each configuration whose step
differs in what it runs (the quick start: GRPO with the engine asleep between rollouts; PPO
with a critic, a reference model and offloaded states; rollouts ahead of training with
partial rollouts; multi-turn rollouts with tool calls). Compiles are counted by JAX's own
backend-compile events (`hybridjax.metrics.compiled_programs`, what `perf/num_compiles`
counts), never by a timing; a failure names the programs and where they compiled."""

from __future__ import annotations

import os

import pytest

from hybridjax.metrics import compiled_programs
from hybridjax.rl.trainer import RLTrainer
from hybridjax.tools import ToolCall
from hybridjax.tools.chat import ChatTools
from tests.rl.tiny_run import load_config_file, read_metrics

pytestmark = pytest.mark.slow

STEPS = 3  # validation before training and after step 2: step 1 and the first are warm-up
TOOLS = os.path.join("configs", "tools", "calculator.yaml")


def _quickstart(run_dir, **changes):
    """`configs/quickstart.py` (its shipped model and arithmetic problems, whose prompts are
    27-29 tokens: every prefill and decode bucket of a run is met in warm-up) at a test's
    size, with `changes` (dotted keys)."""
    c = load_config_file("quickstart")
    c.data.train_batch_size = 4
    c.data.val_max_samples = 8
    for role in (c.actor_rollout_ref.actor, c.critic):
        role.ppo_mini_batch_size = 4
        role.ppo_micro_batch_size_per_gpu = 2  # 16 rows over 8 devices
    c.actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu = 2
    c.actor_rollout_ref.rollout.n = 4
    c.trainer.default_local_dir = str(run_dir)
    c.trainer.logger = ("jsonl",)
    c.trainer.progress_bar = False
    c.trainer.total_training_steps = STEPS
    c.trainer.val_before_train = True
    c.trainer.test_freq = 2
    c.trainer.save_freq = 1  # the first checkpoint is saved in warm-up, after step 1
    if "resource_pool" in changes:
        c.resource_pool = changes.pop("resource_pool")
    c.update_from_flattened_dict(changes)
    return c


OFFLOAD = ("param_offload", "optimizer_offload")
CONFIGS = {
    # GRPO with rollout.free_cache_engine (the default): the engine sleeps after every rollout
    "quickstart": {},
    "ppo_critic_offload": {
        "algorithm.adv_estimator": "gae",
        "critic.enable": True,  # the actor's checkpoint with a fresh value head
        "actor_rollout_ref.actor.use_kl_loss": True,  # a reference model
        **{f"actor_rollout_ref.actor.fsdp_config.{k}": True for k in OFFLOAD},
        "actor_rollout_ref.ref.fsdp_config.param_offload": True,
        **{f"critic.model.fsdp_config.{k}": True for k in OFFLOAD},
    },
    # the rollout on 4 of the 8 devices, training on the other 4
    "async_partial_rollout": {
        "resource_pool": {
            "rollout_pool": {"n_devices": 4},
            "global_pool": {"n_devices": 4},
        },
        "placement.rollout": "rollout_pool",
        "trainer.rollout_mode": "async",
        "trainer.staleness_threshold": 2,
        "trainer.partial_rollout": True,
    },
    "multi_turn": {
        "data.max_response_length": 48,
        "actor_rollout_ref.rollout.response_length": 48,
        "actor_rollout_ref.rollout.multi_turn.enable": True,
        "actor_rollout_ref.rollout.multi_turn.tool_config_path": TOOLS,
        "actor_rollout_ref.rollout.multi_turn.max_assistant_turns": 3,
    },
}


def _calls_every_turn(self, turn_ids):
    """Every assistant turn read as one calculator call (the warm start writes none)."""
    return [ToolCall("calculator", {"expression": "6*7"})]


# The engine's bucketed programs: JAX's name → the prefix of `Engine.compile_counts` keys.
ENGINE_PROGRAMS = {
    "jit(_prefill_fn)": "prefill",
    "jit(_extend_fn)": "extend",
    "jit(_decode_call)": "decode",
    "jit(_copy_fn)": "copy_pages",
}
# Multi-turn and partial rollouts: how many trajectories end a turn together, or are carried
# into the next round, is data, so a later extend or decode call may meet a row bucket
# (`slots.prefill_bucket`, `slots.decode_batch_size`) or page-table width no earlier call met.
# Such a shape compiles once, when first met (bounded by the bucket sets), never again.
NEW_BUCKETS_MAY_COMPILE = {"multi_turn", "async_partial_rollout"}


def _compiles_by_phase(trainer: RLTrainer) -> dict[str, tuple[list[str], list[str]]]:
    """Runs `trainer.fit()`, recording what compiled in each phase (the validation before
    training, each step with the checkpoint saved after it and after its validation if any,
    each validation): (JAX's program names, the engine's programs by shape)."""
    phases: dict[str, tuple[list[str], list[str]]] = {}
    engine = trainer.engine
    seen = {"phase": "start", "jax": len(compiled_programs())}
    seen["engine"] = engine.compile_counts.copy()

    def enter(phase: str) -> None:
        names = compiled_programs()
        jax_names, shapes = phases.setdefault(seen["phase"], ([], []))
        jax_names += names[seen["jax"] :]
        shapes += sorted((engine.compile_counts - seen["engine"]).elements())
        seen.update(phase=phase, jax=len(names), engine=engine.compile_counts.copy())

    train_step, validate = trainer.train_step, trainer.validate

    def counted_step(n):
        enter(f"step {n}")
        return train_step(n)

    def counted_validation():
        enter(f"validation after step {trainer.global_step}")
        out = validate()
        enter(f"step {trainer.global_step}, after its validation")
        return out

    trainer.train_step, trainer.validate = counted_step, counted_validation
    trainer.fit()
    enter("end")
    return phases


def _new_buckets_only(late: dict, compile_counts) -> bool:
    """Whether every compile of the `late` phases is an engine program of a shape compiled
    once in the whole run (a bucket met for the first time). Taken over all of them together:
    a rollout thread may trace a program in one phase and compile it in the next."""
    jax_names = [n for names, _ in late.values() for n in names]
    shapes = [s for _, found in late.values() for s in found]
    kinds = sorted(ENGINE_PROGRAMS.get(n, n) for n in jax_names)
    return kinds == sorted(s.split("(")[0] for s in shapes) and all(
        compile_counts[s] == 1 for s in shapes
    )


@pytest.mark.parametrize("name", list(CONFIGS))
def test_nothing_compiles_after_the_first_step_and_validation(name, tmp_path, monkeypatch):
    if name == "multi_turn":
        monkeypatch.setattr(ChatTools, "parse", _calls_every_turn)
    cfg = _quickstart(tmp_path / "run", **dict(CONFIGS[name]))
    trainer = RLTrainer(cfg)
    try:
        phases = _compiles_by_phase(trainer)
    finally:
        trainer.close()
    order = list(phases)
    assert "validation after step 2" in order and f"step {STEPS}" in order, order
    warm = max(order.index("step 1"), order.index("validation after step 0"))
    late = {p: phases[p] for p in order[warm + 1 :] if any(phases[p])}
    if name in NEW_BUCKETS_MAY_COMPILE:
        assert _new_buckets_only(late, trainer.engine.compile_counts), f"{name}: {late}"
    else:
        assert not late, f"{name}: compiled after warm-up: {late}"
        metrics = read_metrics(tmp_path / "run")
        assert metrics[STEPS]["perf/num_compiles"] == metrics[2]["perf/num_compiles"]
    if name == "multi_turn":  # the tool's answers were appended (`Engine.extend` ran)
        assert read_metrics(tmp_path / "run")[STEPS]["multi_turn/tool_calls"] > 0
