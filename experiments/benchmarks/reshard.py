"""Re-layout benchmark: `update_weights` training → generation layout against copying the bytes.

`python -m experiments.benchmarks.reshard [--sizes=25M,100M,400M] [--layouts=...]` runs on 8
simulated CPU devices and writes `results/YYYYMMDD_HHMMSS/{config.json,summary.json,log.txt,
reshard.png}` through `experiments.benchmarks.run` (also reachable as `run --config=...` with
`benchmark="reshard"`).

For each parameter set (a Qwen2-shaped `CausalLM` of about 25M / 100M / 400M float32 values,
initialised straight into the training layout) and each layout pair, it times (median and
best of `repeats` after one warm-up; the 1-minute load average is recorded beside them):

* `reshard_s`  — `update_weights(params, generation shardings)`, the hybrid engine's move;
* `copy_s`     — numpy `np.copyto` of the same number of bytes as the move writes (every
  device's destination shards, replicas included) between two preallocated, already-touched
  buffers: the memory-bandwidth limit of this machine;
* `host_round_trip_s` — `jax.device_put(jax.device_get(params), generation shardings)`, the
  naive path through one host copy.

`max_leaf_scratch_bytes_per_device` is the largest XLA scratch of one leaf's move: peak device
memory is the training copy + the generation copy + at most that.

The ratios `reshard_s / copy_s` (goal ≤ 2 from 100M up) and `reshard_s / host_round_trip_s`
go into `summary.json`. On one CPU the 8 "devices" share the same memory and cores, so this
measures memory traffic and XLA's collective implementation (a thread rendezvous per collective),
not an interconnect. On CPU, `device_put` of a numpy array may alias host memory instead of
copying it, which makes the host round trip look cheaper than the bytes it claims to place.
"""

from __future__ import annotations

import json
import logging
import os
import pathlib
import statistics
import time

import numpy as np
from ml_collections import ConfigDict

log = logging.getLogger(__name__)

# Qwen2-shaped models (tied embeddings) of about 25M, 100M and 400M parameters.
SIZES = {
    "25M": dict(vocab_size=8192, hidden_size=512, intermediate_size=1536, num_hidden_layers=7,
                num_attention_heads=8, num_key_value_heads=4),
    "100M": dict(vocab_size=16384, hidden_size=768, intermediate_size=2048, num_hidden_layers=14,
                 num_attention_heads=12, num_key_value_heads=4),
    "400M": dict(vocab_size=32768, hidden_size=1024, intermediate_size=4096, num_hidden_layers=23,
                 num_attention_heads=16, num_key_value_heads=8),
    "tiny": dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                 num_attention_heads=8, num_key_value_heads=8),  # for the smoke test
}  # fmt: skip
# name → (mesh.train data, expert, fsdp, tensor; mesh.generate data, tensor)
LAYOUTS = {
    "fsdp4xtp2->dp4xtp2": ((1, 1, 4, 2), (4, 2)),
    "fsdp8->tp8": ((1, 1, 8, 1), (1, 8)),
}
COPY_CHUNK_BYTES = 256 << 20


def default_config() -> ConfigDict:
    """Settings of the `reshard` benchmark (the `reshard` node of a benchmark config)."""
    return ConfigDict(
        dict(
            devices=8,
            sizes="25M,100M,400M",
            layouts=",".join(LAYOUTS),
            repeats=5,
            dtype="",  # "" keeps float32; "bfloat16" casts during the move
        )
    )


def _times(fn, repeats: int) -> dict[str, float]:
    """Median and best of `repeats` timed calls after one warm-up (compiles, page faults). The
    best is the least disturbed by other processes on a shared machine."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return dict(median=statistics.median(times), best=min(times))


def numpy_copy_seconds(nbytes: int, repeats: int) -> dict[str, float]:
    """Seconds for `np.copyto` to write `nbytes` (in chunks of at most 256 MiB between two
    preallocated, touched buffers, so only memory bandwidth is measured)."""
    chunk = min(nbytes, COPY_CHUNK_BYTES) // 4
    src, dst = np.ones(chunk, np.float32), np.zeros(chunk, np.float32)
    full, rest = divmod(nbytes // 4, chunk)

    def copy():
        for _ in range(full):
            np.copyto(dst, src)
        np.copyto(dst[:rest], src[:rest])

    return _times(copy, repeats)


def measure(size: str, layout: str, repeats: int, dtype: str = "") -> dict:
    """Times one parameter set and layout pair; returns the row of `summary.json`."""
    import jax
    from flax import nnx

    from hybridjax.models.config import ModelConfig
    from hybridjax.models.decoder import CausalLM
    from hybridjax.sharding import (
        ACTOR_GENERATE_RULES,
        ACTOR_TRAIN_RULES,
        MeshConfig,
        init_sharded,
        make_meshes,
        move_memory_bytes,
        state_shardings,
        update_weights,
    )

    config = ModelConfig(**SIZES[size], tie_word_embeddings=True)
    train, generate = LAYOUTS[layout]
    meshes = make_meshes(MeshConfig(train=train, generate=generate))
    start = time.perf_counter()
    _, params = nnx.split(init_sharded(CausalLM, config, meshes.train, ACTOR_TRAIN_RULES))
    init_s = time.perf_counter() - start
    shardings = state_shardings(params, meshes.generate, ACTOR_GENERATE_RULES)
    cast = dtype or None
    moved_bytes = update_weights(params, shardings, cast)[1]
    reshard = _times(lambda: update_weights(params, shardings, cast), repeats)
    copy = numpy_copy_seconds(moved_bytes, repeats)
    host = _times(
        lambda: jax.block_until_ready(jax.device_put(jax.device_get(params), shardings)), repeats
    )
    param_bytes = sum(x.nbytes for x in jax.tree.leaves(params))
    pairs = zip(jax.tree.leaves(params), jax.tree.leaves(shardings), strict=True)
    scratch = max(move_memory_bytes(x, s, cast)["temp"] for x, s in pairs)
    row = dict(
        size=size,
        layout=layout,
        num_params=config.num_params(),
        param_bytes=param_bytes,
        reshard_bytes=moved_bytes,
        max_leaf_scratch_bytes_per_device=scratch,
        init_s=init_s,
        load_average_1min=os.getloadavg()[0],
    )
    for stat in ("median", "best"):
        row |= {
            f"reshard_s_{stat}": reshard[stat],
            f"copy_s_{stat}": copy[stat],
            f"host_round_trip_s_{stat}": host[stat],
            f"reshard_gb_per_s_{stat}": moved_bytes / reshard[stat] / 1e9,
            f"copy_gb_per_s_{stat}": moved_bytes / copy[stat] / 1e9,
            f"ratio_to_copy_{stat}": reshard[stat] / copy[stat],
            f"ratio_to_host_round_trip_{stat}": reshard[stat] / host[stat],
        }
    log.info("%s", json.dumps(row))
    return row


def run(cfg: ConfigDict, out_dir: pathlib.Path) -> dict:
    """Every (size, layout) row plus the goal check (`ratio_to_copy` ≤ 2 from 100M up)."""
    del out_dir
    rows = [
        measure(size, layout, cfg.repeats, cfg.dtype)
        for size in str(cfg.sizes).split(",")
        for layout in str(cfg.layouts).split(",")
    ]
    big = [r for r in rows if r["num_params"] >= 80e6]
    return dict(
        rows=rows,
        goal="reshard_s <= 2 x copy_s from 100M parameters up",
        goal_met_median=bool(big) and all(r["ratio_to_copy_median"] <= 2 for r in big),
        goal_met_best=bool(big) and all(r["ratio_to_copy_best"] <= 2 for r in big),
    )


def plot(summary: dict, out_dir: pathlib.Path) -> None:
    """`reshard.png`: seconds per parameter set for the move and both baselines, per layout."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    layouts = sorted({r["layout"] for r in summary["rows"]})
    fig, axes = plt.subplots(1, len(layouts), figsize=(6 * len(layouts), 4), squeeze=False)
    for ax, layout in zip(axes[0], layouts, strict=True):
        rows = [r for r in summary["rows"] if r["layout"] == layout]
        x = [r["num_params"] / 1e6 for r in rows]
        for key, label in (
            ("reshard_s_median", "update_weights"),
            ("copy_s_median", "numpy copy, same bytes"),
            ("host_round_trip_s_median", "device_get + device_put"),
        ):
            ax.plot(x, [r[key] for r in rows], marker="o", label=label)
        ax.set(xscale="log", yscale="log", xlabel="parameters (M)", ylabel="seconds", title=layout)
        ax.legend()
    fig.tight_layout()
    fig.savefig(out_dir / "reshard.png", dpi=100)
    plt.close(fig)


def main() -> None:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    defaults = default_config()
    for key in ("sizes", "layouts", "repeats", "dtype"):
        parser.add_argument(f"--{key}", type=type(defaults[key]), default=defaults[key])
    args = parser.parse_args()
    import jax

    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_num_cpu_devices", defaults.devices)
    from experiments.benchmarks.run import run_benchmark

    settings = ConfigDict({**defaults.to_dict(), **vars(args)})
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    print(run_benchmark(ConfigDict(dict(benchmark="reshard", reshard=settings))))


if __name__ == "__main__":
    main()
