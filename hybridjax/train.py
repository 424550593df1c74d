"""`python -m hybridjax.train [--config=configs/x.py] [--config.a.b=value ...] [--export_hf=DIR]`

Runs RL training (PPO, GRPO, ...) as configured; with `--export_hf=DIR` it instead restores the
newest checkpoint (`trainer.resume_mode`) and writes the actor as an HF checkpoint to DIR
(refused if DIR is not empty, unless `--overwrite`; the checkpoint directory is only read).
Without `--config`, `DEFAULT_CONFIG` runs. A user error (config, data, model files,
checkpoints, export target, a full disk) ends the run with one message and exit code 2; set
`HYBRIDJAX_DEBUG=1` for the traceback (`hybridjax.errors`).
"""

from __future__ import annotations

import logging
import os

from absl import app, flags
from absl import logging as absl_logging
from ml_collections import config_flags

from hybridjax.errors import cli_errors

DEFAULT_CONFIG = os.path.join(
    os.path.dirname(os.path.dirname(__file__)), "configs", "quickstart.py"
)

_CONFIG = config_flags.DEFINE_config_file("config", DEFAULT_CONFIG, "trainer config file")
_EXPORT_HF = flags.DEFINE_string(
    "export_hf", "", "write the restored actor as an HF checkpoint here, then exit"
)
_OVERWRITE = flags.DEFINE_bool(
    "overwrite", False, "let --export_hf replace a directory that is not empty"
)


def run(config, export_hf: str = "", overwrite: bool = False) -> None:
    """Trains per `config`, or exports its newest checkpoint to `export_hf`."""
    from hybridjax.checkpointing.export import check_export_target, export_actor
    from hybridjax.trainer.trainer import RLTrainer

    if export_hf:
        check_export_target(os.path.abspath(export_hf), overwrite)
    trainer = RLTrainer(config, read_only=bool(export_hf))
    try:
        if export_hf:
            export_actor(trainer, export_hf, overwrite)
        else:
            trainer.fit()
            from hybridjax.metrics.plots import write_plots

            write_plots(os.path.join(config.trainer.default_local_dir, "logs"))
    finally:
        trainer.close()


def main(argv: list[str]) -> None:
    del argv
    # hybridjax's own INFO lines (compiles, resume); orbax and absl only from WARNING up.
    absl_logging.set_verbosity(absl_logging.WARNING)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("hybridjax").setLevel(logging.INFO)
    with cli_errors("hybridjax.train"):
        run(_CONFIG.value, _EXPORT_HF.value, _OVERWRITE.value)


if __name__ == "__main__":
    app.run(main)
