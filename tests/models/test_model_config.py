"""`ModelConfig.from_hf_dict` on the config.json forms transformers v4 and v5 write."""

import pytest

from hybridjax.models import ModelConfig

BASE = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
)
LLAMA31_SCALING = {
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


def test_rope_v4_and_v5_forms_agree():
    v4 = ModelConfig.from_hf_dict(
        {
            **BASE,
            "architectures": ["LlamaForCausalLM"],
            "rope_theta": 500000.0,
            "rope_scaling": {**LLAMA31_SCALING, "rope_type": "llama3"},
        }
    )
    v5 = ModelConfig.from_hf_dict(
        {
            **BASE,
            "architectures": ["LlamaForCausalLM"],
            "rope_parameters": {**LLAMA31_SCALING, "rope_type": "llama3", "rope_theta": 500000.0},
        }
    )
    assert v4 == v5
    assert v4.rope_theta == 500000.0
    assert v4.rope_scaling_dict == {**LLAMA31_SCALING, "rope_type": "llama3"}


def test_rope_default_and_legacy_type_key():
    default = ModelConfig.from_hf_dict(
        {
            **BASE,
            "model_type": "qwen2",
            "rope_parameters": {"rope_type": "default", "rope_theta": 1e6},
        }
    )
    assert default.rope_scaling is None and default.rope_theta == 1e6
    linear = ModelConfig.from_hf_dict(
        {**BASE, "model_type": "llama", "rope_scaling": {"type": "linear", "factor": 2.0}}
    )
    assert linear.rope_scaling_dict == {"rope_type": "linear", "factor": 2.0}
    assert linear.rope_theta == 10000.0


def test_unknown_rope_type_is_named():
    with pytest.raises(ValueError, match="'yarn'.*llama3"):
        ModelConfig.from_hf_dict(
            {**BASE, "model_type": "llama", "rope_scaling": {"rope_type": "yarn", "factor": 4.0}}
        )


@pytest.mark.parametrize(
    "fields, window",
    [
        ({"use_sliding_window": False, "sliding_window": 4096}, None),
        # HF applies the window to layers >= max_window_layers (default 28): none of 2 here.
        ({"use_sliding_window": True, "sliding_window": 4096}, None),
        ({"use_sliding_window": True, "sliding_window": 16, "max_window_layers": 0}, 16),
        (
            {
                "sliding_window": 16,
                "layer_types": ["sliding_attention"] * 2,
                "use_sliding_window": True,
            },
            16,
        ),
    ],
)
def test_qwen2_sliding_window(fields, window):
    config = ModelConfig.from_hf_dict({**BASE, "architectures": ["Qwen2ForCausalLM"], **fields})
    assert config.sliding_window == window


def test_qwen2_mixed_windows_are_rejected():
    with pytest.raises(ValueError, match="per-layer sliding windows"):
        ModelConfig.from_hf_dict(
            {
                **BASE,
                "model_type": "qwen2",
                "use_sliding_window": True,
                "sliding_window": 16,
                "max_window_layers": 1,
            }
        )


def test_mistral_window_follows_sliding_window():
    mistral = {**BASE, "architectures": ["MistralForCausalLM"]}
    assert ModelConfig.from_hf_dict({**mistral, "sliding_window": 4096}).sliding_window == 4096
    assert ModelConfig.from_hf_dict({**mistral, "sliding_window": None}).sliding_window is None


@pytest.mark.parametrize(
    "config",
    [
        ModelConfig(family="qwen2", attention_bias=True, tie_word_embeddings=True, head_dim=16),
        ModelConfig(
            family="llama",
            rope_theta=500000.0,
            rope_scaling=tuple(sorted({**LLAMA31_SCALING, "rope_type": "llama3"}.items())),
            head_dim=32,
            eos_token_id=(1, 2),
        ),
        ModelConfig(family="mistral", sliding_window=32, head_dim=16),
        ModelConfig(family="qwen2", attention_bias=True, sliding_window=8, head_dim=16),
    ],
)
def test_hf_dict_round_trip(config):
    assert ModelConfig.from_hf_dict(config.to_hf_dict()) == config


def test_head_dim_defaults_to_width_over_heads():
    assert ModelConfig.from_hf_dict({**BASE, "model_type": "qwen2"}).head_dim == 16


@pytest.mark.parametrize("value", ["2", 2.5, True, [2, "3"]])
def test_token_ids_that_are_not_integers_are_named(value):
    """A config.json's eos_token_id (bos, pad) that is not an integer (or a list of them) is
    refused in one line naming it, not compared with the vocabulary later as a string."""
    hf = {"architectures": ["Qwen2ForCausalLM"], "vocab_size": 16, "hidden_size": 8,
          "intermediate_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2,
          "eos_token_id": value}  # fmt: skip
    with pytest.raises(ValueError, match=r"^eos_token_id must be an integer token id or a list"):
        ModelConfig.from_hf_dict(hf)
    assert ModelConfig.from_hf_dict(hf | {"eos_token_id": [2, 3]}).eos_token_id == (2, 3)
