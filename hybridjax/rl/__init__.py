"""The RL trainer: the batch, the stages of a step, the loop.

from hybridjax.config.schema import base_config
from hybridjax.rl import RLTrainer, default_pipeline, stage
trainer = RLTrainer(config)   # validates, builds models on their meshes
trainer.fit()                 # resumes, trains, validates, checkpoints

@stage(reads=("token_level_scores",), writes=("token_level_scores",))
def my_stage(batch, ctx): ...
pipeline = default_pipeline(config).insert_after("reward", my_stage)
RLTrainer(config, pipeline=pipeline).fit()
"""

from hybridjax.rl.nan_guard import NonFiniteLossError
from hybridjax.rl.pipeline import Deferred, Pipeline, PipelineError, Stage, StepContext, stage
from hybridjax.rl.step import default_pipeline
from hybridjax.rl.trainer import RLTrainer
from hybridjax.training.batch import RLBatch, make_batch

__all__ = [
    "Deferred",
    "Pipeline",
    "PipelineError",
    "Stage",
    "StepContext",
    "NonFiniteLossError",
    "RLBatch",
    "RLTrainer",
    "default_pipeline",
    "make_batch",
    "stage",
]
