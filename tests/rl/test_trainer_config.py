"""Config files load, validate, and bad values fail naming their keys — all in one message."""

from __future__ import annotations

import subprocess
import sys

import pytest
from ml_collections import ConfigDict

from hybridjax.config.checks import ConfigError
from hybridjax.models.config import ModelConfig
from hybridjax.rl.checks import validate
from tests.rl.tiny_run import REPO, load_config_file

ACTOR = {"actor_rollout_ref.model": ModelConfig(num_attention_heads=4, num_key_value_heads=2)}


def _load(name, tmp_path):
    """A shipped config whose parquet paths point at (empty) files that exist."""
    config = load_config_file(name)
    for key in ("train_files", "val_files"):
        path = tmp_path / f"{key}.parquet"
        path.touch()
        config.data[key] = str(path)
    return config


@pytest.mark.parametrize(
    "name", ["tiny", "gsm8k_ppo", "gsm8k_grpo", "gsm8k_multiturn", "gsm8k_grpo_genrm"]
)
def test_shipped_configs_are_valid_on_8_devices(name, tmp_path):
    config = _load(name, tmp_path)
    if config.reward_model.enable and not config.reward_model.model.path:
        config.reward_model.model.path = "/models/Qwen2.5-7B-Instruct"  # the judge
    if (
        not config.actor_rollout_ref.model.path
        and not config.actor_rollout_ref.model.override_config
    ):
        config.actor_rollout_ref.model.path = "/models/Qwen2.5-0.5B-Instruct"
    validate(config, 8, ACTOR)


def test_calculator_tool_demonstration_config_is_valid_on_one_device(tmp_path):
    config = _load("arithmetic_tools", tmp_path)  # a CPU config: one device, like the quick start
    assert config.actor_rollout_ref.rollout.multi_turn.enable
    validate(config, 1, ACTOR)


def test_recipes_keep_verl_quick_start_values():
    ppo, grpo = load_config_file("gsm8k_ppo"), load_config_file("gsm8k_grpo")
    assert ppo.data.train_batch_size == 256
    assert ppo.actor_rollout_ref.actor.optim.lr == 1e-6 and ppo.critic.optim.lr == 1e-5
    assert ppo.data.max_prompt_length == ppo.data.max_response_length == 512
    assert ppo.algorithm.adv_estimator == "gae" and ppo.critic.enable
    assert grpo.actor_rollout_ref.rollout.n == 5 and grpo.algorithm.adv_estimator == "grpo"
    actor = grpo.actor_rollout_ref.actor
    assert actor.use_kl_loss and actor.kl_loss_type == "low_var_kl" and actor.kl_loss_coef == 0.001


def test_every_problem_is_reported_with_its_key(tmp_path):
    config = _load("tiny", tmp_path)
    config.actor_rollout_ref.actor.optim.lr = -1.0  # range
    config.algorithm.adv_estimator = "ppo2"  # registry lookup
    config.data.truncation = "sideways"  # choice
    config.actor_rollout_ref.actor.ppo_mini_batch_size = 3  # 16 % 3 != 0
    config.actor_rollout_ref.rollout.response_length = 64  # != data.max_response_length
    config.data.val_files = "missing.parquet"
    with pytest.raises(ConfigError) as err:
        validate(config, 8, ACTOR)
    message = str(err.value)
    for key in (
        "actor_rollout_ref.actor.optim.lr",
        "algorithm.adv_estimator",
        "'gae'",  # the valid estimator names are listed
        "data.truncation",
        "actor_rollout_ref.actor.ppo_mini_batch_size (3)",
        "actor_rollout_ref.rollout.response_length (64)",
        "data.val_files: no such file 'missing.parquet'",
    ):
        assert key in message, (key, message)


def test_unknown_keys_and_wrong_types_are_named():
    """A config file that builds its own dicts (not from `base_config()`) is still checked."""
    raw = load_config_file("tiny").to_dict()
    raw["trainer"]["unlocked"] = True  # not in the schema
    raw["trainer"]["save_freq"] = "often"
    raw["actor_rollout_ref"]["model"]["override_config"]["hiden_size"] = 8
    del raw["algorithm"]["lam"]
    config = ConfigDict(raw)
    with pytest.raises(ConfigError) as err:
        validate(config, 8, ACTOR)
    message = str(err.value)
    assert "trainer.unlocked: unknown key" in message
    assert "trainer.save_freq: expected int, got str ('often')" in message
    assert "unknown model fields ['hiden_size']" in message
    assert "algorithm.lam: missing" in message


def test_micro_batches_must_tile_the_mini_batch_over_devices(tmp_path):
    config = _load("tiny", tmp_path)
    config.actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu = 3  # 8 × 1 responses vs 3 × 8
    with pytest.raises(ConfigError, match=r"ppo_micro_batch_size_per_gpu × data-parallel size "
                       r"\(3 × 8 = 24\)"):  # fmt: skip
        validate(config, 8, ACTOR)
    config = _load("tiny", tmp_path)
    config.mesh.train.data = 3  # 3 does not divide 8 devices
    with pytest.raises(ConfigError, match="mesh.train.data=3"):
        validate(config, 8, ACTOR)


def test_remat_policy_needs_gradient_checkpointing_and_a_known_name(tmp_path):
    config = _load("tiny", tmp_path)
    config.actor_rollout_ref.model.remat_policy = "dots_with_no_batch_dims"
    with pytest.raises(ConfigError, match="enable_gradient_checkpointing=True"):
        validate(config, 8, ACTOR)
    config.actor_rollout_ref.model.enable_gradient_checkpointing = True
    validate(config, 8, ACTOR)
    config.actor_rollout_ref.model.remat_policy = "minimal"
    with pytest.raises(ConfigError, match="actor_rollout_ref.model.remat_policy"):
        validate(config, 8, ACTOR)


def test_command_line_overrides_reach_validation():
    """`--config.a.b=x` overrides through config_flags; bad values exit naming the keys."""
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "hybridjax.train",
            f"--config={REPO / 'configs' / 'tiny.py'}",
            "--config.data.train_batch_size=12",
            "--config.actor_rollout_ref.rollout.top_p=1.5",
        ],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=300,
    )
    assert out.returncode != 0
    assert "data.train_batch_size (12) must be divisible" in out.stderr
    assert "actor_rollout_ref.rollout.top_p: must be in (0, 1] (got 1.5)" in out.stderr


def test_estimator_inputs_are_checked_at_start(tmp_path):
    config = _load("tiny", tmp_path)
    config.critic.enable = False  # GAE without a critic has no values
    config.trainer.logger = ("console", "mlflow")  # not a logger
    with pytest.raises(ConfigError, match="trainer.logger") as err:
        validate(config, 8, ACTOR)
    config.trainer.logger = ("console",)
    with pytest.raises(ConfigError, match="'gae': .*values_BxT.*critic.enable=True") as err:
        validate(config, 8, ACTOR)
    assert "1 problem" in str(err.value)
    config.algorithm.adv_estimator = "grpo"
    validate(config, 8, ACTOR)


def test_remax_is_accepted_and_new_keys_are_checked(tmp_path):
    """ReMax validates (its greedy baseline is generated, not missing); rollout IS and the
    overlong buffer name their keys."""
    config = _load("tiny", tmp_path)
    config.algorithm.adv_estimator = "remax"
    config.critic.enable = False
    validate(config, 8, ACTOR)
    config.data.train_batch_size = 4  # 4 greedy prompts over 8 data shards
    config.actor_rollout_ref.actor.ppo_mini_batch_size = 4
    config.algorithm.rollout_is = True  # without a threshold
    config.algorithm.rollout_is_level = "word"
    config.reward_model.overlong_buffer.enable = True
    config.reward_model.overlong_buffer.len = 32  # = data.max_response_length
    with pytest.raises(ConfigError) as err:
        validate(config, 8, ACTOR)
    message = str(err.value)
    for key in (
        "data.train_batch_size (4) must be divisible by the data-parallel size (8)",
        "algorithm.rollout_is is true but algorithm.rollout_is_threshold is 0",
        "algorithm.rollout_is_level: one of ('token', 'sequence', 'geometric') (got 'word')",
        "reward_model.overlong_buffer.len (32) must be in (0, data.max_response_length = 32)",
    ):
        assert key in message, (key, message)


def test_reward_keys_are_checked(tmp_path):
    config = _load("tiny", tmp_path)
    config.reward_model.reward_manager = "dapo"  # turns the overlong shaping on: len is 0
    config.reward_model.combine = "mean"
    config.reward_model.remote.batch_size = 0
    config.reward_model.enable = True  # neither a model.path nor remote.urls
    with pytest.raises(ConfigError) as err:
        validate(config, 8, ACTOR)
    message = str(err.value)
    for key in (
        "reward_model.overlong_buffer.len (0) must be in (0, data.max_response_length = 32) "
        "when enabled (reward_model.reward_manager=dapo enables it)",
        "reward_model.combine: one of ('replace', 'sum') (got 'mean')",
        "reward_model.remote.batch_size: must be > 0 (got 0)",
        "reward_model.enable is true but reward_model.model.path and reward_model.remote.urls",
    ):
        assert key in message, (key, message)
    config.reward_model.reward_manager = "verl"
    with pytest.raises(ConfigError, match=r"reward_model.reward_manager: one of \('naive'"):
        validate(config, 8, ACTOR)
