"""The memory planner (`hybridjax.plan`) against measured peaks on CPU.

For each model size, a fresh process with one CPU device builds a GRPO config's models for
real, plans it, then runs the `old_log_prob` and `update_actor` stages and measures what each
call adds to the process's memory at its peak: the larger of the growth of its address space
(VmSize sampled every 0.2 ms by a second process: XLA maps a program's scratch whole,
touched or not) and of its
resident memory (VmHWM, reset through /proc/self/clear_refs just before the call, minus VmRSS
before it: memory the heap already held is reused without growing VmSize). The planner
predicts that as the stage's outputs − donated bytes + XLA scratch (the resident states, the
rest of a stage's peak, are exact shard sizes). Error = predicted / measured − 1.

CPU only says how well XLA's buffer assignment predicts XLA's own allocations; a GPU program
fuses differently, so GPU scratch differs (run `experiments/gpu/check.sh` for GPU peaks).

Config keys (`memory`): models (comma-separated `<hidden>x<layers>`), batch (prompts), n,
prompt_length, response_length, micro_batch (responses per micro-batch), timeout_s.
"""

from __future__ import annotations

import json
import logging
import os
import pathlib
import subprocess
import sys

log = logging.getLogger(__name__)
STAGES = ("old_log_prob", "update_actor")


def _status(key: str) -> int:
    """A `/proc/self/status` field in bytes (VmRSS, VmHWM)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(key)


_SAMPLER = """
import sys, time
path = f"/proc/{sys.argv[1]}/status"
def size():
    with open(path) as f:
        return next(int(l.split()[1]) * 1024 for l in f if l.startswith("VmSize:"))
peak = size()
print("ready", flush=True)
import select
while not select.select([sys.stdin], [], [], 0.0002)[0]:
    peak = max(peak, size())
print(max(peak, size()), flush=True)
"""


class _PeakSize:
    """Samples this process's VmSize (allocated address space) every 0.2 ms from another
    process while in the block (a thread would wait for the GIL while a jitted call holds it):
    XLA maps a program's scratch whole, but pages it never touches stay out of RSS."""

    def __enter__(self):
        cmd = [sys.executable, "-c", _SAMPLER, str(os.getpid())]
        self._proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert self._proc.stdout.readline().strip() == "ready"
        return self

    def __exit__(self, *exc):
        out, _ = self._proc.communicate("stop\n", timeout=60)
        self.max = int(out.split()[-1])


def point_config(hidden: int, layers: int, cfg) -> object:
    """A GRPO trainer config with a random `hidden`×`layers` model and the benchmark's sizes."""
    from configs.tiny import get_config

    c = get_config()
    m = c.actor_rollout_ref.model
    m.override_config.hidden_size = hidden
    m.override_config.intermediate_size = 4 * hidden
    m.override_config.num_hidden_layers = layers
    m.override_config.num_attention_heads = max(hidden // 64, 1)
    m.override_config.num_key_value_heads = max(hidden // 128, 1)
    c.critic.enable = False
    c.algorithm.adv_estimator = "grpo"
    a = c.actor_rollout_ref
    a.rollout.n = cfg["n"]
    c.data.train_batch_size = a.actor.ppo_mini_batch_size = cfg["batch"]
    c.data.max_prompt_length = a.rollout.prompt_length = cfg["prompt_length"]
    c.data.max_response_length = a.rollout.response_length = cfg["response_length"]
    a.actor.ppo_micro_batch_size_per_gpu = cfg["micro_batch"]
    a.rollout.log_prob_micro_batch_size_per_gpu = cfg["micro_batch"]
    a.actor.recompute_old_log_prob = "true"  # measure the forward pass too
    c.mesh.train.data, c.mesh.train.fsdp = 1, 1
    return c


def measure_point(hidden: int, layers: int, cfg: dict) -> dict:
    """Plans and runs one model size in this process (one CPU device); returns the numbers."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec

    from hybridjax.memory import planner as plan
    from hybridjax.sharding import BATCH_AXES, MeshConfig, make_meshes
    from hybridjax.training import build, passes

    c = point_config(hidden, layers, cfg)
    actor_config = build.actor_model_config(c, build.load_tokenizer(c))
    p = plan.plan_memory(c, actor_config, 1, capacity_bytes=1 << 40, target="cpu")
    meshes = make_meshes(MeshConfig.from_config(c), jax.devices()[:1])
    sc = build.stage_config(c, 1, 1, actor_config)
    models = build.build_models(c, actor_config, meshes.train, sc, False)
    rows = c.data.train_batch_size * c.actor_rollout_ref.rollout.n
    sharding = NamedSharding(meshes.train, PartitionSpec(BATCH_AXES))
    abstract = plan.abstract_batch(
        rows, c.data.max_prompt_length, c.data.max_response_length, sharding, ["advantages"]
    )
    key = iter(jax.random.split(jax.random.key(0), 16))
    fill = lambda s: (
        jax.random.randint(next(key), s.shape, 0, actor_config.vocab_size, s.dtype)
        if s.dtype == jnp.int32
        else jax.random.normal(next(key), s.shape, s.dtype)
    )
    batch = jax.tree.map(lambda s: jax.device_put(fill(s), s.sharding), abstract)
    batch = batch.replace(
        attention_mask=jnp.ones_like(batch.attention_mask),
        response_mask=jnp.ones_like(batch.response_mask),
    )
    # Compiled ahead of time, so each program's first execution is the one measured: a later
    # execution may reuse address space its predecessor left mapped.
    key_, graphdef, state = jax.random.key(1), models.actor_graphdef, models.actor_state
    old = jax.jit(passes.compute_old_log_prob, static_argnums=(0, 3))
    old = old.lower(graphdef, state.params, batch, sc).compile()
    update_batch = plan.abstract_batch(
        rows,
        c.data.max_prompt_length,
        c.data.max_response_length,
        sharding,
        ["advantages", "old_log_probs"],
    )
    update = jax.jit(passes.update_actor, static_argnums=(0, 4), donate_argnums=1)
    update = update.lower(graphdef, state, update_batch, key_, sc).compile()
    calls = {
        "old_log_prob": lambda: old(state.params, batch)[0],
        "update_actor": lambda: update(state, batch_old, key_)[0],
    }
    out = {"hidden": hidden, "layers": layers, "num_params": actor_config.num_params()}
    for name in STAGES:
        before, size_before = _status("VmRSS"), _status("VmSize")
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset VmHWM to the current RSS
        with _PeakSize() as peak:
            result = jax.block_until_ready(calls[name]())
        resident = _status("VmHWM") - before
        measured = max(peak.max - size_before, resident)
        if name == "old_log_prob":
            batch_old = result
        consumers = next(s for s in p.stages if s.name == name).consumers
        counted = {k[len(name) + 1 :]: v for k, v in consumers.items() if k.startswith(name)}
        predicted = sum(counted.values())  # outputs − donated + the counted live bytes
        xla = counted["outputs"] + p.xla_cpu_scratch[name]
        error = lambda x: x / measured - 1 if measured > 0 else None
        out[name] = {
            "predicted_bytes": predicted,
            "measured_bytes": measured,
            "measured_resident_bytes": resident,
            "error": error(predicted),
            "counted_bytes": counted,
            "xla_cpu_predicted_bytes": xla,
            "xla_cpu_error": error(xla),
        }
        log.info("%dx%d %s: %s", hidden, layers, name, out[name])
    return out


def run(cfg, out_dir: pathlib.Path) -> dict:
    """One subprocess per model size (a clean heap each); returns every point's numbers."""
    settings = {k: cfg[k] for k in ("batch", "n", "prompt_length", "response_length")}
    settings["micro_batch"] = cfg.micro_batch
    env = os.environ | {"JAX_PLATFORMS": "cpu", "JAX_NUM_CPU_DEVICES": "1"}
    env["PYTHONPATH"] = os.pathsep.join([os.getcwd(), env.get("PYTHONPATH", "")])
    points = []
    for spec in cfg.models.split(","):
        hidden, layers = (int(x) for x in spec.split("x"))
        cmd = [sys.executable, "-m", "experiments.benchmarks.memory", str(hidden), str(layers)]
        cmd.append(json.dumps(settings))
        done = subprocess.run(
            cmd, env=env, capture_output=True, text=True, timeout=cfg.timeout_s, check=False
        )
        if done.returncode != 0:
            raise RuntimeError(f"memory point {spec} failed:\n{done.stderr[-3000:]}")
        points.append(json.loads(done.stdout.strip().splitlines()[-1]))
        log.info("point %s: %s", spec, points[-1])
    errors = [abs(p[s]["error"]) for p in points for s in STAGES if p[s]["error"] is not None]
    return {
        "settings": settings,
        "points": points,
        "max_abs_error": max(errors) if errors else None,
    }


def plot(summary: dict, out_dir: pathlib.Path) -> None:
    """Predicted against measured bytes per stage and model (`memory.png`)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 4))
    top = 0.0
    for i, stage in enumerate(STAGES):
        xs = [p[stage]["measured_bytes"] / 1e6 for p in summary["points"]]
        ys = [p[stage]["predicted_bytes"] / 1e6 for p in summary["points"]]
        ax.scatter(xs, ys, label=stage, color=f"C{i}")
        top = max(top, *xs, *ys)
    ax.plot([0, top], [0, top], color="gray", linewidth=0.8)
    ax.set_xlabel("measured MB (growth of VmSize or RSS during the call)")
    ax.set_ylabel("planned MB (outputs − donated + scratch)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out_dir / "memory.png", dpi=100)
    plt.close(fig)


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING)
    point = measure_point(int(sys.argv[1]), int(sys.argv[2]), json.loads(sys.argv[3]))
    print(json.dumps(point))
