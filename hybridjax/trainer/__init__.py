"""The RL trainer: config schema and validation, the batch, the stages of a step, the loop.

from hybridjax.trainer import RLTrainer, base_config, default_pipeline, stage
trainer = RLTrainer(config)   # validates, builds models on their meshes
trainer.fit()                 # resumes, trains, validates, checkpoints

@stage(reads=("token_level_scores",), writes=("token_level_scores",))
def my_stage(batch, ctx): ...
pipeline = default_pipeline(config).insert_after("reward", my_stage)
RLTrainer(config, pipeline=pipeline).fit()
"""

from hybridjax.trainer.batch import RLBatch, make_batch
from hybridjax.trainer.config import base_config
from hybridjax.trainer.nan_guard import NonFiniteLossError
from hybridjax.trainer.pipeline import Deferred, Pipeline, PipelineError, Stage, StepContext, stage
from hybridjax.trainer.step import default_pipeline
from hybridjax.trainer.trainer import RLTrainer
from hybridjax.trainer.validate import ConfigError, validate

__all__ = [
    "ConfigError",
    "Deferred",
    "Pipeline",
    "PipelineError",
    "Stage",
    "StepContext",
    "NonFiniteLossError",
    "RLBatch",
    "RLTrainer",
    "base_config",
    "default_pipeline",
    "make_batch",
    "stage",
    "validate",
]
