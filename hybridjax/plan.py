"""`python -m hybridjax.plan --config=configs/x.py --devices=8 --device_memory_gb=80 [--target=...]`

Prints the per-device memory plan of a config (`hybridjax.memory.planner`). `--target=gpu` (the
default) or `cpu` plans on simulated CPU devices: the hand count, with XLA:CPU's scratch as a
reference. `--target=a100` / `h100` compiles every program of the step with XLA:GPU for
`--devices` compile-only A100-SXM4-80GB / H100-SXM-80GB (`hybridjax.memory.gpu_targets`; needs
`pip install 'hybridjax[gpu-aot]'`) and prints XLA:GPU's peak of each stage beside the hand
count (docs/gpu-planning.md).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import jax

from hybridjax.memory import planner

if TYPE_CHECKING:
    from absl import flags
    from ml_collections import ConfigDict

_CONFIG: flags.FlagHolder[ConfigDict]  # the config file's flag, defined by `cli`


def main(argv: list[str]) -> None:
    del argv
    import json

    from absl import flags

    f = flags.FLAGS
    # Simulated CPU devices (or compile-only GPUs beside them): before JAX starts its backend.
    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_num_cpu_devices", f.devices)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    from hybridjax.allocator import ENV, memory_fraction
    from hybridjax.config.run import resolve_dtypes
    from hybridjax.memory import gpu_targets
    from hybridjax.sharding import check_parallelism
    from hybridjax.training import build

    gpu = f.target in gpu_targets.TARGETS
    if gpu and (problem := gpu_targets.missing_plugin(f.target)):
        raise SystemExit(problem)
    backend = "gpu" if gpu else f.target
    cfg = resolve_dtypes(_CONFIG.value, backend)  # `auto`: the planned devices' dtype
    if cfg.actor_rollout_ref.model.path:
        actor_config = build.actor_model_config(cfg, tokenizer=None)
    else:
        actor_config = build.actor_model_config(cfg, build.load_tokenizer(cfg))
    try:  # mesh, batch and head-count checks (data files need not exist to plan)
        check_parallelism(cfg, f.devices, {"actor_rollout_ref.model": actor_config})
    except ValueError as err:
        raise SystemExit(str(err)) from None
    fraction = memory_fraction(cfg.trainer.device_memory_fraction) if backend == "gpu" else 1.0
    capacity = int(f.device_memory_gb * planner.GB * fraction)
    devices = gpu_targets.compile_only_devices(f.target, f.devices) if gpu else None
    plan = planner.plan_memory(cfg, actor_config, f.devices, capacity, backend, f.xla, devices)
    print(
        f"budget per device: {planner.size(capacity)} = {fraction:g} × {f.device_memory_gb:g} GB "
        f"(the allocator's fraction: trainer.device_memory_fraction or {ENV})"
    )
    print(plan.report())
    if f.json:
        summary = {"num_params": actor_config.num_params(), "target": f.target}
        summary |= {"jax": jax.__version__, **plan.to_dict()}
        with open(f.json, "w") as out:
            json.dump(summary, out, indent=2)
    if not plan.fits:
        raise SystemExit(1)


def cli() -> None:
    """`python -m hybridjax.plan`: defines the command-line flags, then runs `main`."""
    global _CONFIG
    from absl import app, flags
    from ml_collections import config_flags

    _CONFIG = config_flags.DEFINE_config_file("config", None, "trainer config file")
    flags.DEFINE_integer("devices", 8, "devices the run will use")
    flags.DEFINE_float("device_memory_gb", 80.0, "memory of one device, GB (10^9 bytes)")
    flags.DEFINE_enum(
        "target",
        "gpu",
        ["gpu", "cpu", "a100", "h100"],
        "backend the run will use; a100 / h100: compile every program with XLA:GPU for "
        "compile-only A100-SXM4-80GB / H100-SXM-80GB (needs hybridjax[gpu-aot])",
    )
    flags.DEFINE_string("json", "", "also write the plan here as JSON")
    flags.DEFINE_bool(
        "xla",
        True,
        "compile each stage (XLA's outputs, donated bytes, CPU scratch as a reference); "
        "--noxla counts from shapes only, in seconds",
    )
    flags.mark_flag_as_required("config")
    app.run(main)


if __name__ == "__main__":
    cli()
