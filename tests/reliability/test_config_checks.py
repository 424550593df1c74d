"""The up-front config check: every key it can judge without building a model, with the
valid choices in the message; keys that were accepted and ignored are now read."""

from __future__ import annotations

import pathlib

import pytest

from hybridjax.errors import ConfigError
from hybridjax.rl.checks import validate
from hybridjax.training import build
from tests.rl.tiny_run import REPO, load_config_file

DATA = REPO / "hybridjax" / "assets" / "quickstart" / "data"


def _config(**changes):
    c = load_config_file("tiny")
    c.data.train_files = str(DATA / "train.parquet")
    c.data.val_files = str(DATA / "test.parquet")
    c.update_from_flattened_dict(changes)
    return c


def _problems(**changes) -> str:
    with pytest.raises(ConfigError) as err:
        validate(_config(**changes), 8)
    return str(err.value)


def test_the_tiny_config_passes():
    validate(_config(), 8)


@pytest.mark.parametrize(
    "key, value, needles",
    [
        ("reward_model.on_error", "ignore", ["reward_model.on_error", "'zero', 'raise'"]),
        ("actor_rollout_ref.model.dtype", "float17", ["model.dtype", "'bfloat16'"]),
        ("actor_rollout_ref.rollout.dtype", "fp8", ["rollout.dtype", "'float16'"]),
        ("actor_rollout_ref.rollout.attention_impl", "flash", ["'auto', 'jnp', 'pallas'"]),
        ("actor_rollout_ref.rollout.name", "vllm", ["rollout.name", "'hybridjax'"]),
        ("trainer.resume_mode", "latest", ["trainer.resume_mode", "'auto', 'disable'"]),
        ("data.special_tokens_in_content", "drop", ["'keep', 'escape', 'error'"]),
        ("actor_rollout_ref.actor.clip_ratio", 1.5, ["actor.clip_ratio: must be in (0, 1)"]),
        ("actor_rollout_ref.actor.router_replay.mode", "R4", ["'disabled', 'R2', 'R3'"]),
        ("actor_rollout_ref.actor.moe_aux_loss_coeff", -0.1, ["actor.moe_aux_loss_coeff"]),
    ],
)
def test_bad_choice_names_key_and_choices(key, value, needles):
    message = _problems(**{key: value})
    for needle in needles:
        assert needle in message


def test_paths_are_checked_and_nothing_is_created(tmp_path):
    missing = tmp_path / "runs" / "global_step_7"
    message = _problems(**{"trainer.resume_mode": str(missing)})
    assert f"no checkpoint at '{missing}'" in message and "none" in message
    assert not (tmp_path / "runs").exists()
    (tmp_path / "runs" / "global_step_2").mkdir(parents=True)
    assert "global_step_2" in _problems(**{"trainer.resume_mode": str(missing)})
    validate(_config(**{"trainer.resume_mode": str(tmp_path / "runs" / "global_step_2")}), 8)
    a_file = tmp_path / "notes.txt"
    a_file.write_text("x")
    assert "default_local_dir: " in _problems(**{"trainer.default_local_dir": str(a_file)})
    assert "is a directory" in _problems(**{"data.train_files": str(DATA)})


def _reward(tmp_path: pathlib.Path, source: str) -> str:
    path = tmp_path / "reward.py"
    path.write_text(source)
    return str(path)


@pytest.mark.parametrize(
    "source, name, needle",
    [
        (None, "compute_score", "is not a file or an importable module"),
        ("import no_such_module_xyz\n", "compute_score", "ModuleNotFoundError"),
        ("def other(a, b, c, d=None):\n    return 0.0\n", "compute_score", "'compute_score'"),
        ("def compute_score(text):\n    return 0.0\n", "compute_score", "expected fn(data_source"),
        ("def f(data_source, solution_str, ground_truth, extra_info=None):\n    return 0.0\n",
         "f", None),
    ],
)  # fmt: skip
def test_custom_reward_function_is_loaded_and_its_signature_checked(tmp_path, source, name, needle):
    path = _reward(tmp_path, source) if source else str(tmp_path / "missing.py")
    changes = {"custom_reward_function.path": path, "custom_reward_function.name": name}
    if needle is None:
        validate(_config(**changes), 8)
    else:
        message = _problems(**changes)
        assert needle in message and "custom_reward_function" in message


def test_clip_ratio_is_followed_unless_low_or_high_are_set():
    loss = build.stage_config(_config(**{"actor_rollout_ref.actor.clip_ratio": 0.1}), 10, 8)
    assert (loss.actor_loss.clip_ratio_low, loss.actor_loss.clip_ratio_high) == (0.1, 0.1)
    c = _config(**{"actor_rollout_ref.actor.clip_ratio": 0.1})
    c.actor_rollout_ref.actor.clip_ratio_high = 0.28  # DAPO's clip-higher
    loss = build.stage_config(c, 10, 8).actor_loss
    assert (loss.clip_ratio_low, loss.clip_ratio_high) == (0.1, 0.28)


def test_reference_pass_has_its_own_micro_batch():
    c = _config()
    c.actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu = 1
    c.actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu = 2
    sc = build.stage_config(c, 10, 8)
    assert (sc.ref_log_prob_micro_batch_size, sc.log_prob_micro_batch_size) == (8, 16)


@pytest.mark.parametrize(
    "key, value",
    [("trainer.resume_mode", "latest"), ("data.truncation", "left"), ("model.dtype", "fp8")],
)
def test_sft_choices_are_checked_before_anything_runs(key, value, tmp_path):
    from hybridjax.offline.sft import run_sft, sft_config

    c = sft_config()
    c.trainer.default_local_dir = str(tmp_path / "run")
    c.update_from_flattened_dict({key: value})
    with pytest.raises(ConfigError, match=rf"{key}: one of .*got '{value}'"):
        run_sft(c)
    assert not (tmp_path / "run").exists()


MT = "actor_rollout_ref.rollout.multi_turn"
CALCULATOR = str(REPO / "configs" / "tools" / "calculator.yaml")


def _one_problem(**changes) -> str:
    """The single line the check reports for `changes`."""
    message = _problems(**changes)
    assert message.startswith("invalid config (1 problem):\n  "), message
    return message.splitlines()[1].strip()


def test_multi_turn_with_the_calculator_passes():
    validate(_config(**{f"{MT}.enable": True, f"{MT}.tool_config_path": CALCULATOR}), 8)


@pytest.mark.parametrize(
    "key, value, needle",
    [
        ("max_assistant_turns", -1, f"{MT}.max_assistant_turns: must be >= 1 (got -1)"),
        ("max_parallel_calls", 0, f"{MT}.max_parallel_calls: must be >= 1 (got 0)"),
        ("max_tool_response_length", 0, f"{MT}.max_tool_response_length: must be >= 1"),
        ("tool_workers", 0, f"{MT}.tool_workers: must be >= 1"),
        ("tool_timeout_s", 0.0, f"{MT}.tool_timeout_s: must be > 0 seconds"),
        ("format", "json", f"{MT}.format: one of ['hermes'] (got 'json')"),
        ("tool_response_truncate_side", "top", f"{MT}.tool_response_truncate_side: one of"),
    ],
)
def test_multi_turn_limits_and_choices_name_the_key(key, value, needle):
    line = _one_problem(
        **{f"{MT}.enable": True, f"{MT}.tool_config_path": CALCULATOR, f"{MT}.{key}": value}
    )
    assert line.startswith(needle), line


def test_multi_turn_tool_config_file_problems(tmp_path):
    on = {f"{MT}.enable": True}
    assert (
        _one_problem(**on) == f"{MT}.tool_config_path: empty; {MT}.enable needs a tool config file"
    )
    missing = str(tmp_path / "tools.yaml")
    line = _one_problem(**on, **{f"{MT}.tool_config_path": missing})
    assert line == f"{MT}.tool_config_path: no such file {missing!r}"
    unknown = tmp_path / "unknown.yaml"
    unknown.write_text("tools:\n  - class_name: web_search\n")
    line = _one_problem(**on, **{f"{MT}.tool_config_path": str(unknown)})
    assert line.startswith(f"{MT}.tool_config_path: {unknown}: tools[0]: class_name 'web_search'")
    assert "['calculator', 'python', 'sandbox_fusion']" in line
    twice = tmp_path / "twice.yaml"
    twice.write_text("tools:\n  - class_name: calculator\n  - class_name: calculator\n")
    line = _one_problem(**on, **{f"{MT}.tool_config_path": str(twice)})
    assert line == f"{MT}.tool_config_path: two tools are named 'calculator'"
    broken = tmp_path / "broken.yaml"
    broken.write_text("tools: [\n")
    assert _one_problem(**on, **{f"{MT}.tool_config_path": str(broken)}).startswith(
        f"{MT}.tool_config_path: "
    )


def test_multi_turn_incompatible_or_ignored_settings():
    line = _one_problem(
        **{
            f"{MT}.enable": True,
            f"{MT}.tool_config_path": CALCULATOR,
            "actor_rollout_ref.rollout.ignore_eos": True,
        }
    )
    assert line.startswith(f"{MT}.enable needs actor_rollout_ref.rollout.ignore_eos=False")
    line = _one_problem(**{f"{MT}.tool_config_path": CALCULATOR})
    assert line.startswith(f"{MT}.tool_config_path is set") and "enable is False" in line


def test_router_replay_needs_unpacked_passes_and_the_old_log_prob_pass():
    r2 = {"actor_rollout_ref.actor.router_replay.mode": "R2"}
    assert "use_remove_padding=False" in _problems(**r2)
    unpacked = r2 | {"actor_rollout_ref.model.use_remove_padding": False}
    validate(_config(**unpacked), 8)
    message = _problems(**unpacked, **{"actor_rollout_ref.actor.recompute_old_log_prob": "false"})
    assert "records the experts in the old_log_prob pass" in message


def test_router_replay_r3_and_the_engine_recording_go_together():
    """R3 replays what the engine records (`rollout.enable_rollout_routing_replay`): either
    key without the other is rejected, naming both; with both (and unpacked passes) the
    config passes, with the same packing rule as R2."""
    r3 = {"actor_rollout_ref.actor.router_replay.mode": "R3"}
    record = {"actor_rollout_ref.rollout.enable_rollout_routing_replay": True}
    unpacked = {"actor_rollout_ref.model.use_remove_padding": False}
    for changes in (r3, record):
        message = _problems(**changes, **unpacked)
        assert "router_replay.mode='R3'" in message
        assert "enable_rollout_routing_replay=True" in message
    assert "use_remove_padding=False" in _problems(**r3, **record)
    validate(_config(**r3, **record, **unpacked), 8)


R = "actor_rollout_ref.rollout"  # tiny: prompt 256 + response 32 tokens, 16-token pages, n = 1


@pytest.mark.parametrize(
    "changes, needle",
    [
        ({f"{R}.decode_steps_per_call": 0}, f"{R}.decode_steps_per_call: must be > 0 (got 0)"),
        ({f"{R}.min_prefill_bucket": 0}, f"{R}.min_prefill_bucket: must be > 0"),
        (
            {f"{R}.page_size": 4096},
            f"{R}.page_size: must be in [1, prompt_length + response_length",
        ),
        ({f"{R}.num_pages": 1}, f"{R}.num_pages: must be -1 (sized from memory) or >= 18"),
        ({f"{R}.num_pages": 2, f"{R}.n": 2}, "or >= 21 (one group of n=2 samples"),
    ],
)
def test_engine_sizes_name_the_key_and_the_valid_range(changes, needle):
    message = _problems(**changes)
    assert needle in message, message
    assert len(message.splitlines()) == 2  # "invalid config (1 problem):" and the one line


def test_the_smallest_pool_the_check_allows_serves_a_group():
    validate(_config(**{f"{R}.num_pages": 18}), 8)


@pytest.mark.parametrize(
    "entry, needle",
    [
        (
            "after gen: ./no_such_stages.py:fn",
            "'./no_such_stages.py' is not a file or an importable module (no such file",
        ),
        ("after gen: {tmp}:fn", "(a directory, and not a module name)"),
        ("after gen: {tmp}/broken.py:fn", "broken.py, line 1: "),
        ("after gen: no_such_module_xyz:fn", "'no_such_module_xyz' is not a file or an importable"),
        (
            "after gen: {tmp}/failing.py:fn",
            "importing '{tmp}/failing.py' failed: ModuleNotFoundError",
        ),
        ("after gen: {tmp}/exiting.py:fn", "importing '{tmp}/exiting.py' failed: SystemExit: 3"),
    ],
)
def test_a_bad_stages_path_is_one_line(entry, needle, tmp_path):
    (tmp_path / "broken.py").write_text("def fn(batch, ctx:\n")
    (tmp_path / "failing.py").write_text("import no_such_module_xyz\ndef fn(batch, ctx): ...\n")
    (tmp_path / "exiting.py").write_text("raise SystemExit(3)\n")
    entry = entry.replace("{tmp}", str(tmp_path))
    message = _problems(**{"trainer.stages": (entry,)})
    assert "trainer.stages: " in message and needle.replace("{tmp}", str(tmp_path)) in message
    assert len(message.splitlines()) == 2, message


def test_greedy_samples_under_a_group_estimator_warn_that_advantages_are_zero(caplog):
    grpo = {"algorithm.adv_estimator": "grpo", "critic.enable": False, f"{R}.n": 4}
    validate(_config(**grpo, **{f"{R}.temperature": 0.0}), 8)
    validate(_config(**grpo, **{f"{R}.do_sample": False}), 8)
    lines = [r.getMessage() for r in caplog.records if "every advantage 0" in r.getMessage()]
    assert len(lines) == 2 and f"{R}.temperature=0 with rollout.n=4" in lines[0]
    assert "do_sample=False" in lines[1] and "'grpo'" in lines[0]
    caplog.clear()
    validate(_config(**grpo, **{f"{R}.top_k": 1}), 8)  # greedy by another name
    assert f"{R}.top_k=1 with rollout.n=4" in caplog.text
    caplog.clear()
    validate(_config(**grpo, **{f"{R}.temperature": 1e-30}), 8)  # every update was non-finite
    assert f"{R}.temperature=1e-30 is near 0" in caplog.text
    caplog.clear()
    validate(_config(**grpo), 8)  # sampled: no warning
    validate(_config(**{f"{R}.temperature": 0.0, f"{R}.n": 4}), 8)  # GAE: a critic's baseline
    assert "every advantage" not in caplog.text


def test_an_eos_outside_the_vocabulary_warns_in_one_line(caplog):
    from hybridjax.models.config import ModelConfig
    from hybridjax.rl.checks import validate_models

    config = _config()
    shape = dict(hidden_size=8, intermediate_size=16, num_hidden_layers=1)
    shape |= dict(num_attention_heads=2, num_key_value_heads=1)
    inside = ModelConfig(vocab_size=100, eos_token_id=(7, 99), **shape)
    validate_models(config, 8, {"actor_rollout_ref.model": inside})
    assert "outside the vocabulary" not in caplog.text
    outside = ModelConfig(vocab_size=100, eos_token_id=(7, 100), **shape)
    validate_models(config, 8, {"actor_rollout_ref.model": outside})
    lines = [r.getMessage() for r in caplog.records if "outside the vocabulary" in r.getMessage()]
    assert lines == [
        "actor_rollout_ref.model: eos_token_id 100 is outside the vocabulary (vocab_size 100), "
        "so no response ends before rollout.response_length; fix the tokenizer's or the "
        "model's eos_token_id (model.override_config.eos_token_id)"
    ]


def test_an_integer_beyond_32_bits_is_one_line():
    """decode_steps_per_call=10**12 passed its check (> 0) and overflowed int32 in the engine."""
    message = _problems(**{f"{R}.decode_steps_per_call": 10**12})
    assert f"{R}.decode_steps_per_call: must be below 2**31" in message and "10**" not in message
    assert "(got 1000000000000)" in message
