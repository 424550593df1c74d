"""`python -m hybridjax.train [--config=configs/x.py] [--config.a.b=value ...] [--export_hf=DIR]`

Runs RL training (PPO, GRPO, ...) as configured; with `--export_hf=DIR` it instead restores the
newest checkpoint (`trainer.resume_mode`) and writes the actor as an HF checkpoint to DIR.
Without `--config`, `DEFAULT_CONFIG` runs.
"""

from __future__ import annotations

import logging
import os
import sys

from absl import app, flags
from absl import logging as absl_logging
from ml_collections import config_flags

DEFAULT_CONFIG = os.path.join(
    os.path.dirname(os.path.dirname(__file__)), "configs", "quickstart.py"
)

_CONFIG = config_flags.DEFINE_config_file("config", DEFAULT_CONFIG, "trainer config file")
_EXPORT_HF = flags.DEFINE_string(
    "export_hf", "", "write the restored actor as an HF checkpoint here, then exit"
)


def main(argv: list[str]) -> None:
    del argv
    # hybridjax's own INFO lines (compiles, resume); orbax and absl only from WARNING up.
    absl_logging.set_verbosity(absl_logging.WARNING)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("hybridjax").setLevel(logging.INFO)
    from hybridjax.checkpointing.export import export_actor
    from hybridjax.sharding.hosts import DistributedConfig, initialize, is_main
    from hybridjax.trainer.trainer import RLTrainer
    from hybridjax.trainer.validate import ConfigError

    try:
        initialize(DistributedConfig.from_config(_CONFIG.value))  # before any other JAX call
    except ValueError as err:
        sys.exit(str(err))
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
                write_plots(os.path.join(_CONFIG.value.trainer.default_local_dir, "logs"))
    finally:
        trainer.close()


if __name__ == "__main__":
    app.run(main)
