"""Decoder models (Qwen2 / Qwen3 / Qwen3-MoE / Llama / Mistral), HF checkpoint I/O."""

from hybridjax.models.attention import DenseKVCache
from hybridjax.models.config import ModelConfig
from hybridjax.models.decoder import CausalLM, SequenceClassifier, Transformer
from hybridjax.models.hf_io import load_pretrained, save_pretrained

__all__ = [
    "CausalLM",
    "DenseKVCache",
    "ModelConfig",
    "SequenceClassifier",
    "Transformer",
    "load_pretrained",
    "save_pretrained",
]
