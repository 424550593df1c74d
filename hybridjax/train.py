"""`python -m hybridjax.train [--config=configs/x.py] [--config.a.b=value ...] [--export_hf=DIR]`

Runs RL training (PPO, GRPO, ...) as configured; with `--export_hf=DIR` it instead restores the
newest checkpoint (`trainer.resume_mode`) and writes the actor as an HF checkpoint to DIR
(refused if DIR is not empty; `--overwrite` replaces only an earlier export; the checkpoint
directory is only read; see `hybridjax.checkpointing.export`).
Without `--config`, `DEFAULT_CONFIG` runs. A user error (config, data, model files,
checkpoints, export target, a full disk) ends the run with one message and exit code 2; set
`HYBRIDJAX_DEBUG=1` for the traceback (`hybridjax.errors`).
"""

from __future__ import annotations

import os

from absl import flags
from ml_collections import config_flags

from hybridjax.allocator import set_allocator_fraction
from hybridjax.compilation_cache import set_compilation_cache
from hybridjax.errors import ConfigError, cli_errors, run_main
from hybridjax.metrics.console import configure_logging

DEFAULT_CONFIG = os.path.join(
    os.path.dirname(os.path.dirname(__file__)), "configs", "quickstart.py"
)

_CONFIG = config_flags.DEFINE_config_file("config", DEFAULT_CONFIG, "trainer config file")
_EXPORT_HF = flags.DEFINE_string(
    "export_hf", "", "write the restored actor as an HF checkpoint here, then exit"
)
_OVERWRITE = flags.DEFINE_bool(
    "overwrite", False, "let --export_hf replace an earlier export (and only that)"
)


def run(config, export_hf: str = "", overwrite: bool = False) -> None:
    """Trains per `config`, or exports its newest checkpoint to `export_hf`.

    Raises:
      UserError (`hybridjax.errors`): a config, data, model, checkpoint or export problem.
    """
    from hybridjax.checkpointing import hold_directory
    from hybridjax.checkpointing.export import (
        check_export_target,
        export_actor,
        export_inputs,
        export_protected,
    )
    from hybridjax.checkpointing.run_lock import hold_run_directory
    from hybridjax.rl.trainer import RLTrainer
    from hybridjax.sharding.hosts import DistributedConfig, initialize, is_main, process_suffix

    configure_logging(None)  # quiet console while JAX starts (its backend INFO lines)
    try:
        set_allocator_fraction(config.trainer.device_memory_fraction)  # before JAX starts
        initialize(DistributedConfig.from_config(config))  # before any other JAX call
        set_compilation_cache(config.trainer.compilation_cache_dir)  # before the first compile
    except ValueError as err:
        raise ConfigError(str(err)) from err
    # console: progress bar, step lines, warnings; INFO (compiles, resume) to the log file
    # unless --verbosity=0 (one file per process: train.log, train.process1.log, ...). An
    # export only reads the run's directory, so it logs to the console alone.
    out = config.trainer.default_local_dir
    logs = os.path.join(out, "logs")
    writable = not export_hf and (os.path.isdir(out) or not os.path.lexists(out))
    lock = hold_run_directory(config) if writable and is_main() else None  # before any write
    configure_logging(os.path.join(logs, f"train{process_suffix()}.log") if writable else None)
    if export_hf:  # checked first (a refused target gets no lock file beside it), held as a
        # run holds its directory, then checked again under the lock
        target = (os.path.abspath(export_hf), overwrite, export_protected(config))
        check_export_target(*target, export_inputs(config))
        lock = hold_directory(export_hf, "--export_hf", create=False) if is_main() else None
        check_export_target(*target, export_inputs(config))
    trainer = RLTrainer(config, read_only=bool(export_hf))
    try:
        if export_hf:
            step = export_actor(trainer, export_hf, overwrite)
            if is_main():
                print(f"exported the actor of step {step} to {export_hf}", flush=True)
        else:
            trainer.fit()
            from hybridjax.metrics.plots import write_plots

            if is_main():
                write_plots(logs)
    finally:
        trainer.close()
        if lock is not None:
            lock.release()


def main(argv: list[str]) -> None:
    del argv
    with cli_errors("hybridjax.train"):
        run(_CONFIG.value, _EXPORT_HF.value, _OVERWRITE.value)


if __name__ == "__main__":
    run_main(main, "hybridjax.train")
