"""The RL trainer: config schema and validation, the batch, the stages of a step, the loop.

from hybridjax.trainer import RLTrainer, base_config
trainer = RLTrainer(config)   # validates, builds models on their meshes
trainer.fit()                 # resumes, trains, validates, checkpoints
"""

from hybridjax.trainer.batch import RLBatch, make_batch
from hybridjax.trainer.config import base_config
from hybridjax.trainer.nan_guard import NonFiniteLossError
from hybridjax.trainer.trainer import RLTrainer
from hybridjax.trainer.validate import ConfigError, validate

__all__ = [
    "ConfigError",
    "NonFiniteLossError",
    "RLBatch",
    "RLTrainer",
    "base_config",
    "make_batch",
    "validate",
]
