"""The tiny model and mesh shapes shared by the sharding tests and the two-process worker."""

from hybridjax.models.config import ModelConfig

# vocab, mlp and head counts divisible by tensor=2; embed (64) by fsdp=4.
TINY = ModelConfig(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=1,
    num_attention_heads=4,
    num_key_value_heads=2,
    attention_bias=True,
)
TRAIN_MESH = (1, 1, 4, 2)  # data, expert, fsdp, tensor
GENERATE_MESH = (-1, 2)  # data (= 4), tensor
