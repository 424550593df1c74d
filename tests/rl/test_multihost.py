"""`python -m hybridjax.train` in 2 processes × 4 CPU devices (jax.distributed, gloo on
localhost) gives the result of 1 process × 8 devices: same parameters, same metrics, and a resume
in 2 processes continues exactly. A process killed with -9 ends its peer's run with an error.

The one-process run also starts `jax.distributed` (a single process), so its all-reduces are
gloo's ring as in the two-process run. Without it XLA's in-process all-reduce sums the 8 devices'
gradients in device order, the ring in another order: the float32 roundings then differ (Adam's
moments by up to ~6e-7 of each tensor's largest) and Adam's g/(|g|+ε) turns that into up to ~1e-6
of a parameter where |g| ~ ε = 1e-8 (docs/placement.md, several hosts). With the same
collectives the runs agree bit for bit, so any difference comes from the host-side split."""

from __future__ import annotations

import math
import pathlib
import signal
import socket
import subprocess
import sys
import time

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

from tests.child_env import child_env
from tests.rl.tiny_run import REPO, gsm8k_subset, read_metrics

pytestmark = pytest.mark.slow

CONFIG = """
import pathlib
from tests.rl.tiny_run import tiny_config

def get_config():
    return tiny_config({data!r}, pathlib.Path("."), **{changes!r})
"""
ALGORITHMS = {
    "ppo": {},
    "grpo": {
        "algorithm.adv_estimator": "grpo",
        "critic.enable": False,
        "actor_rollout_ref.rollout.n": 2,
        "actor_rollout_ref.actor.use_kl_loss": True,
    },
}


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return gsm8k_subset(tmp_path_factory.mktemp("gsm8k"), train_rows=32, test_rows=8)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def _launch(
    config: pathlib.Path, run_dir: pathlib.Path, processes: int, steps: int, heartbeat_s: int = 600
):
    """Starts the CLI in `processes` processes over 8 CPU devices in all. A process whose
    heartbeats stop for `heartbeat_s` ends the run (a loaded machine can stall one for 30 s)."""
    env = child_env(
        devices=8 // processes, PYTHONPATH=str(REPO), JAX_DEFAULT_MATMUL_PRECISION="highest"
    )
    args = [
        sys.executable,
        "-m",
        "hybridjax.train",
        f"--config={config}",
        f"--config.trainer.default_local_dir={run_dir}",
        f"--config.trainer.total_training_steps={steps}",
        "--config.trainer.max_actor_ckpt_to_keep=10",
        # also with one process: the same (gloo) collectives, see the module docstring
        f"--config.trainer.distributed.coordinator_address=localhost:{_free_port()}",
        f"--config.trainer.distributed.num_processes={processes}",
        f"--config.trainer.distributed.heartbeat_timeout_s={heartbeat_s}",
    ]
    return [
        subprocess.Popen(
            args + [f"--config.trainer.distributed.process_id={i}"],
            cwd=REPO,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for i in range(processes)
    ]


def _run(config, run_dir, processes, steps):
    procs = _launch(config, run_dir, processes, steps)
    outputs = [p.communicate(timeout=900)[0] for p in procs]
    codes = [p.returncode for p in procs]
    failed = [f"process {i}:\n{_tail(out)}" for i, out in enumerate(outputs) if codes[i] != 0]
    assert not failed, "\n".join(failed)


def _tail(output: str) -> str:
    """The end of a process's output; for a crash, what it printed before the thread dump."""
    crash = output.find("Fatal Python error")
    return output[-3000:] if crash < 0 else output[max(crash - 2500, 0) : crash + 500]


def _state(run_dir: pathlib.Path, step: int) -> dict:
    """The saved state of `step`, restored onto one device of this process."""
    path = run_dir / f"global_step_{step}" / "state"
    checkpointer = ocp.StandardCheckpointer()
    tree = checkpointer.metadata(path).item_metadata
    tree = getattr(tree, "tree", tree)
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    target = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=device),
        tree,
        is_leaf=lambda x: hasattr(x, "shape"),
    )
    restored = checkpointer.restore(path, target)
    leaves = jax.tree_util.tree_flatten_with_path(restored)[0]
    return {jax.tree_util.keystr(path): np.asarray(leaf) for path, leaf in leaves}


def _deterministic(metrics: dict) -> dict:
    skip = ("timing_s/", "perf/", "rollout/num_compiles")
    return {k: v for k, v in metrics.items() if not k.startswith(skip)}


def _assert_same(one: pathlib.Path, two: pathlib.Path, steps: list[int]):
    m1, m2 = read_metrics(one), read_metrics(two)
    for step in steps:
        a, b = _deterministic(m1[step]), _deterministic(m2[step])
        assert a.keys() == b.keys()
        for key in a:
            if isinstance(a[key], float) and math.isfinite(a[key]):
                assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-6), (step, key)
            else:
                assert a[key] == b[key], (step, key)
        s1, s2 = _state(one, step), _state(two, step)
        assert s1.keys() == s2.keys()
        for key in s1:
            np.testing.assert_allclose(s2[key], s1[key], rtol=0, atol=1e-6, err_msg=key)


@pytest.mark.parametrize("algorithm", sorted(ALGORITHMS))
def test_two_processes_match_one(data, tmp_path, algorithm):
    config = tmp_path / "config.py"
    config.write_text(CONFIG.format(data=data, changes=ALGORITHMS[algorithm]))
    one, two = tmp_path / "one", tmp_path / "two"
    steps = 3 if algorithm == "ppo" else 2
    _run(config, one, 1, steps)
    _run(config, two, 2, 2)
    _assert_same(one, two, [1, 2])
    if algorithm == "ppo":  # resume in 2 processes: step 3 as the uninterrupted run's
        _run(config, two, 2, 3)
        _assert_same(one, two, [3])


def _start_training(data, tmp_path):
    """2 processes of a long GRPO run, returned once the first step is logged."""
    config = tmp_path / "config.py"
    config.write_text(CONFIG.format(data=data, changes=ALGORITHMS["grpo"]))
    procs = _launch(config, tmp_path / "run", 2, 1000, heartbeat_s=10)
    metrics = tmp_path / "run" / "logs" / "metrics.jsonl"
    deadline = time.monotonic() + 600
    while not (metrics.exists() and metrics.read_text().strip()):
        assert time.monotonic() < deadline and all(p.poll() is None for p in procs)
        time.sleep(0.5)
    return procs


def test_sigterm_to_one_process_stops_both_after_a_save(data, tmp_path):
    procs = _start_training(data, tmp_path)
    procs[1].send_signal(signal.SIGTERM)
    outputs = [p.communicate(timeout=300)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outputs[0][-3000:] + outputs[1][-3000:]
    last = max(read_metrics(tmp_path / "run"))
    assert (tmp_path / "run" / f"global_step_{last}").is_dir()
    assert last < 1000


def test_killed_process_ends_the_other(data, tmp_path):
    procs = _start_training(data, tmp_path)
    procs[1].send_signal(signal.SIGKILL)
    killed = time.monotonic()
    out = procs[0].communicate(timeout=120)[0]
    assert procs[0].returncode != 0
    assert time.monotonic() - killed < 60
    assert "another task died" in out, out[-3000:]
