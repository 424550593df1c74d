"""Decoder models (Qwen2 / Llama / Mistral), HF checkpoint I/O."""

from hybridjax.models.attention import DenseKVCache
from hybridjax.models.config import ModelConfig
from hybridjax.models.decoder import CausalLM, SequenceClassifier, Transformer

__all__ = ["CausalLM", "DenseKVCache", "ModelConfig", "SequenceClassifier", "Transformer"]
