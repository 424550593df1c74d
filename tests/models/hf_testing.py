"""Model-test helpers: tiny random HF models written by `transformers` (torch CPU, float32).

HF initialises weights with std 0.02, which makes logits nearly constant; `_spread_weights`
redraws them larger (norm scales around 1) so that a wrong transpose, rope or mask shows.
"""

from typing import Any

import jax.numpy as jnp
import numpy as np
import torch
import transformers
from flax import nnx

VOCAB = 128
COMMON: dict[str, Any] = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    pad_token_id=0,
)
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    # With head_dim 16 the wavelengths span 6 … 2·10⁴: high, medium and low bands all occur.
    "original_max_position_embeddings": 32,
}

# family -> (HF config, HF causal LM class, what it exercises)
FAMILIES = {
    # q/k/v bias, tied embeddings
    "qwen2": lambda: (
        transformers.Qwen2Config(**COMMON, tie_word_embeddings=True),
        transformers.Qwen2ForCausalLM,
    ),
    # GQA, untied, llama3 rope scaling
    "llama": lambda: (
        transformers.LlamaConfig(  # type: ignore[call-arg]  # rope keys go through **kwargs
            **COMMON, tie_word_embeddings=False, rope_theta=500000.0, rope_scaling=LLAMA3_ROPE
        ),
        transformers.LlamaForCausalLM,
    ),
    # sliding window shorter than the batch's sequences
    "mistral": lambda: (
        transformers.MistralConfig(**COMMON, sliding_window=8),
        transformers.MistralForCausalLM,
    ),
    # q/k norm, head_dim ≠ hidden / heads, no q/k/v bias, tied embeddings
    "qwen3": lambda: (
        transformers.Qwen3Config(**COMMON, head_dim=24, tie_word_embeddings=True),
        transformers.Qwen3ForCausalLM,
    ),
    # Llama 3.2: tied embeddings, llama3 rope scaling
    "llama3.2": lambda: (
        transformers.LlamaConfig(
            **COMMON, tie_word_embeddings=True, rope_theta=500000.0, rope_scaling=LLAMA3_ROPE
        ),
        transformers.LlamaForCausalLM,
    ),
    "qwen3_moe": lambda: (qwen3_moe_config(), transformers.Qwen3MoeForCausalLM),
}


def qwen3_moe_config(**changes) -> transformers.Qwen3MoeConfig:
    """Tiny Qwen3-MoE: 8 experts, top-2 renormalised, layers 0 and 2 routed, layer 1 dense."""
    kwargs = dict(
        COMMON,
        num_hidden_layers=3,
        head_dim=16,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        mlp_only_layers=[1],
        tie_word_embeddings=False,
    )
    kwargs.update(changes)
    return transformers.Qwen3MoeConfig(**kwargs)


def _spread_weights(model: torch.nn.Module, seed: int) -> None:
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            else:
                p.copy_(0.15 * torch.randn_like(p))


def write_hf_model(path, model_cls, config, seed=0, dtype=torch.float32):
    """Builds a random `model_cls(config)`, saves it to `path`, returns it (eval mode, eager)."""
    torch.manual_seed(seed)
    config._attn_implementation = "eager"
    model = model_cls(config).eval()
    _spread_weights(model, seed)
    model.to(dtype).save_pretrained(path)
    return model.to(torch.float32)


def hf_logits(model, ids, mask, positions) -> np.ndarray:
    """float32 logits B×T×V of a HF causal LM given the same position ids as ours."""
    with torch.no_grad():
        out = model(
            input_ids=torch.tensor(ids),
            attention_mask=torch.tensor(mask),
            position_ids=torch.tensor(positions),
        )
    return out.logits.float().numpy()


def max_valid_diff(a, b, mask) -> float:
    """max |a - b| over valid (mask != 0) positions of B×T×… arrays."""
    return float(np.abs(np.asarray(a) - np.asarray(b))[np.asarray(mask).astype(bool)].max())


@nnx.jit
def _forward(model, ids, mask, positions):
    return model(ids, mask, positions)


def our_logits(model, batch) -> np.ndarray:
    """Our model's float32 outputs on `batch` = (ids, mask, positions); jitted (one compile per
    config and shape, which eager dispatch would pay per op)."""
    return np.asarray(_forward(model, *(jnp.asarray(x) for x in batch)))
