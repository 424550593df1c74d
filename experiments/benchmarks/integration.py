"""Integration benchmark: checkpoint save and restore of the trainer state, and loading the
prompt data from parquet against Arrow IPC.

1. Checkpoints: an actor `TrainState` (parameters + AdamW state, float32, random
   Qwen2-shaped model of `generation.MODELS[model]`, initialised in its training layout) saved
   with `hybridjax.checkpointing.Checkpointer` (orbax, async: `save_s` is the call until the
   controller may continue, `save_total_s` until the files are final) and restored into the
   same shardings (`restore_s`); bytes on disk. Medians over `repeats` after one untimed save.
2. Loading (seed 000's parquet vs arrow comparison): the GSM8K train split (converted from
   `tests/assets/gsm8k`, 7,473 rows) repeated `loading_copies` times, written as parquet
   (pyarrow defaults, snappy) and as an Arrow IPC file (uncompressed); time to read the table
   (memory-mapped for both) and to materialise the `prompt` column as Python objects, file sizes.

3. Reward service (`reward_parts`, comma-separated, "" = none): the parts of
   `experiments.benchmarks.reward_service` run in this process: `rule` (a 5 ms rule function
   in threads, worker processes, one and two reward servers; the built-in GSM8K check) and
   `model` (a reward model in the trainer against one served on its own devices), each with
   `reward_warmup` untimed and `reward_steps` timed steps (medians).

The engine against HF generate and the re-layout (hybrid engine on vs off) are the
`generation` and `reshard` benchmarks. Config keys (`integration`): model, repeats,
loading_copies, reward_parts, reward_warmup, reward_steps.
"""

from __future__ import annotations

import logging
import pathlib
import statistics
import tempfile
import time

log = logging.getLogger(__name__)


def _median_s(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _dir_bytes(path: pathlib.Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def checkpoint_times(model: str, repeats: int, work: pathlib.Path) -> dict:
    """Save / restore seconds and bytes of an actor TrainState (see the module docstring)."""
    import jax
    from flax import nnx

    from experiments.benchmarks.generation import MODELS
    from hybridjax.checkpointing import Checkpointer
    from hybridjax.models.config import ModelConfig
    from hybridjax.models.decoder import CausalLM
    from hybridjax.sharding import ACTOR_TRAIN_RULES, MeshConfig, init_sharded, make_meshes
    from hybridjax.training import build
    from hybridjax.training.optim import OptimConfig

    config = ModelConfig(**MODELS[model], attention_bias=True, tie_word_embeddings=True)
    mesh = make_meshes(MeshConfig()).train
    _, params = nnx.split(init_sharded(CausalLM, config, mesh, ACTOR_TRAIN_RULES))
    optim = OptimConfig(lr=1e-6, warmup_steps=0, total_steps=10)
    state = build.init_train_state(params, optim)
    target = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state
    )
    ckpt = Checkpointer(str(work / "ckpt"), max_to_keep=1)
    save, total, restore = [], [], []
    try:
        ckpt.save(0, {"actor": state}, {"global_step": 0})  # warm-up: orbax's first-save setup
        ckpt.wait()
        for step in range(1, repeats + 1):
            start = time.perf_counter()
            ckpt.save(step, {"actor": state}, {"global_step": step})
            save.append(time.perf_counter() - start)
            ckpt.wait()
            total.append(time.perf_counter() - start)
            start = time.perf_counter()
            restored = ckpt.restore({"actor": target}, step)
            jax.block_until_ready(restored[1])
            restore.append(time.perf_counter() - start)
    finally:
        ckpt.close()
    state_bytes = sum(x.nbytes for x in jax.tree.leaves(state))
    return {
        "model": model,
        "num_params": config.num_params(),
        "state_bytes": state_bytes,
        "disk_bytes": _dir_bytes(work / "ckpt"),
        "save_s": statistics.median(save),
        "save_total_s": statistics.median(total),
        "restore_s": statistics.median(restore),
        "save_gb_per_s": state_bytes / statistics.median(total) / 1e9,
    }


def loading_times(copies: int, repeats: int, work: pathlib.Path) -> dict:
    """Parquet against Arrow IPC for the GSM8K prompt table (see the module docstring)."""
    import pyarrow as pa
    import pyarrow.ipc as ipc
    import pyarrow.parquet as pq

    from hybridjax.data.gsm8k import convert_split

    root = pathlib.Path(__file__).resolve().parents[2]
    convert_split(
        str(root / "tests/assets/gsm8k/train.jsonl"), str(work / "gsm8k.parquet"), "train"
    )
    table = pq.read_table(work / "gsm8k.parquet")
    table = pa.concat_tables([table] * copies)
    parquet, arrow = work / "train.parquet", work / "train.arrow"
    pq.write_table(table, parquet)
    with ipc.new_file(arrow, table.schema) as writer:
        writer.write_table(table)

    def read_parquet():
        return pq.read_table(parquet, memory_map=True)

    def read_arrow():
        with pa.memory_map(str(arrow)) as source:
            return ipc.open_file(source).read_all()

    out = {"rows": table.num_rows}
    for name, read in (("parquet", read_parquet), ("arrow_ipc", read_arrow)):
        out[name] = {
            "file_bytes": (parquet if name == "parquet" else arrow).stat().st_size,
            "read_s": _median_s(read, repeats),
            "read_prompts_s": _median_s(lambda r=read: r().column("prompt").to_pylist(), repeats),
        }
    out["read_ratio_parquet_to_arrow"] = out["parquet"]["read_s"] / out["arrow_ipc"]["read_s"]
    return out


def run(cfg, out_dir: pathlib.Path) -> dict:
    with tempfile.TemporaryDirectory(prefix="hybridjax_integration_") as tmp:
        work = pathlib.Path(tmp)
        summary = {"checkpoint": checkpoint_times(cfg.model, cfg.repeats, work)}
        log.info("checkpoint: %s", summary["checkpoint"])
        summary["loading"] = loading_times(cfg.loading_copies, cfg.repeats, work)
        log.info("loading: %s", summary["loading"])
    summary["reward_service"] = reward_service_times(
        cfg.reward_parts, cfg.reward_warmup, cfg.reward_steps
    )
    return summary


def reward_service_times(parts: str, warmup: int, steps: int) -> dict:
    """The reward service's parts named in `parts` (see the module docstring)."""
    from experiments.benchmarks import reward_service

    known = {"rule": reward_service.rule_part, "model": reward_service.model_part}
    names = [p for p in parts.split(",") if p]
    unknown = sorted(set(names) - set(known))
    if unknown:
        raise ValueError(f"integration.reward_parts: unknown {unknown}; known: rule, model")
    out = {name: known[name](warmup, steps) for name in names}
    log.info("reward service: %s", out)
    return out


def plot(summary: dict, out_dir: pathlib.Path) -> None:
    """Bars of checkpoint and loading seconds (`integration.png`)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    c, d = summary["checkpoint"], summary["loading"]
    bars = {
        "ckpt save (returns)": c["save_s"],
        "ckpt save (final)": c["save_total_s"],
        "ckpt restore": c["restore_s"],
        "parquet read": d["parquet"]["read_s"],
        "arrow IPC read": d["arrow_ipc"]["read_s"],
        "parquet prompts": d["parquet"]["read_prompts_s"],
        "arrow IPC prompts": d["arrow_ipc"]["read_prompts_s"],
    }
    for part, rows in summary.get("reward_service", {}).items():
        bars |= {f"reward {part} {k}": v["median_s"] for k, v in rows.items() if "median_s" in v}
    fig, ax = plt.subplots(figsize=(6, 3.5 + 0.2 * max(len(bars) - 7, 0)))
    ax.barh(list(bars), list(bars.values()), color="C0")
    ax.set_xlabel("seconds (median)")
    fig.tight_layout()
    fig.savefig(out_dir / "integration.png", dpi=100)
    plt.close(fig)
