"""`python -m hybridjax.train [--config=configs/x.py] [--config.a.b=value ...] [--export_hf=DIR]`

Runs RL training (PPO, GRPO, ...) as configured; with `--export_hf=DIR` it instead restores the
newest checkpoint (`trainer.resume_mode`) and writes the actor as an HF checkpoint to DIR.
Without `--config`, `DEFAULT_CONFIG` runs.
"""

from __future__ import annotations

import os
import sys

from absl import app, flags
from ml_collections import config_flags

from hybridjax.metrics.console import configure_logging

DEFAULT_CONFIG = os.path.join(
    os.path.dirname(os.path.dirname(__file__)), "configs", "quickstart.py"
)

_CONFIG = config_flags.DEFINE_config_file("config", DEFAULT_CONFIG, "trainer config file")
_EXPORT_HF = flags.DEFINE_string(
    "export_hf", "", "write the restored actor as an HF checkpoint here, then exit"
)


def main(argv: list[str]) -> None:
    del argv
    from hybridjax.checkpointing.export import export_actor
    from hybridjax.sharding.hosts import DistributedConfig, initialize, is_main, process_suffix
    from hybridjax.trainer.trainer import RLTrainer
    from hybridjax.trainer.validate import ConfigError

    try:
        initialize(DistributedConfig.from_config(_CONFIG.value))  # before any other JAX call
    except ValueError as err:
        sys.exit(str(err))
    # console: progress bar, step lines, warnings; INFO (compiles, resume) to the log file
    # unless --verbosity=0 (one file per process: train.log, train.process1.log, ...)
    logs = os.path.join(_CONFIG.value.trainer.default_local_dir, "logs")
    configure_logging(os.path.join(logs, f"train{process_suffix()}.log"))
    try:
        trainer = RLTrainer(_CONFIG.value)
    except ConfigError as err:
        sys.exit(str(err))
    try:
        if _EXPORT_HF.value:
            export_actor(trainer, _EXPORT_HF.value)
        else:
            trainer.fit()
            from hybridjax.metrics.plots import write_plots

            if is_main():
                write_plots(logs)
    finally:
        trainer.close()


if __name__ == "__main__":
    app.run(main)
