"""Orbax checkpoints: sharded round trip, keep-N, NaN refusal, unreadable steps set aside,
and a process killed (SIGKILL) in the middle of a save leaves the previous step loadable."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec

from hybridjax.checkpointing import Checkpointer, split_checkpoint_path


def _state(value: float):
    mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Auto,))
    sharded = NamedSharding(mesh, PartitionSpec("data"))
    return {
        "w": jax.device_put(jnp.full((16, 4), value, jnp.float32), sharded),
        "step": jnp.int32(value),
        "opt": (jnp.arange(3.0) * value, {"mu": jnp.ones(2) * value}),
    }


def test_round_trip_keeps_values_shardings_and_meta(tmp_path):
    ckpt = Checkpointer(str(tmp_path), max_to_keep=2)
    for step in (1, 2, 3):
        assert ckpt.save(step, _state(step), {"global_step": step, "data": {"epoch": 0}})
    ckpt.wait()
    assert ckpt.steps() == [2, 3]  # keep-2 deleted step 1
    assert sorted(os.listdir(tmp_path)) == ["global_step_2", "global_step_3"]
    target = _state(0.0)
    step, state, meta = ckpt.restore(target)
    assert step == 3 and meta == {"global_step": 3, "data": {"epoch": 0}}
    np.testing.assert_array_equal(state["w"], np.full((16, 4), 3.0))
    assert state["w"].sharding == target["w"].sharding
    np.testing.assert_array_equal(state["opt"][1]["mu"], [3.0, 3.0])
    assert ckpt.restore(target, step=2)[1]["step"] == 2
    ckpt.close()


def test_non_finite_state_is_never_written(tmp_path):
    ckpt = Checkpointer(str(tmp_path), max_to_keep=2)
    bad = _state(1.0)
    bad["opt"][1]["mu"] = jnp.array([1.0, jnp.nan])
    assert not ckpt.save(1, bad, {})
    ckpt.wait()
    assert ckpt.steps() == [] and ckpt.restore(_state(0.0)) is None
    ckpt.close()


def test_unreadable_newest_step_is_skipped_and_set_aside(tmp_path):
    ckpt = Checkpointer(str(tmp_path), max_to_keep=3)
    for step in (1, 2):
        ckpt.save(step, _state(step), {"global_step": step})
    ckpt.wait()
    for root, _, files in os.walk(tmp_path / "global_step_2" / "state"):
        for name in files:
            os.remove(os.path.join(root, name))
    fresh = Checkpointer(str(tmp_path), max_to_keep=3)
    step, state, _ = fresh.restore(_state(0.0))
    assert step == 1 and float(np.asarray(state["w"])[0, 0]) == 1.0
    assert (tmp_path / "global_step_2.unreadable").is_dir()  # kept for inspection
    assert fresh.save(2, _state(5.0), {"global_step": 2})  # the step can be written again
    fresh.close()


def test_split_checkpoint_path():
    assert split_checkpoint_path("/a/b/global_step_12/") == ("/a/b", 12)
    with pytest.raises(ValueError, match="trainer.resume_mode"):
        split_checkpoint_path("/a/b/step12")


SAVER = textwrap.dedent(
    """
    import sys, time
    import jax, jax.numpy as jnp
    from hybridjax.checkpointing import Checkpointer
    ckpt = Checkpointer(sys.argv[1], max_to_keep=2)
    ckpt.save(1, {"w": jnp.ones((4,))}, {"global_step": 1})
    ckpt.wait()
    big = {f"w{i}": jnp.full((1024, 1024), float(i)) for i in range(48)}  # 200 MB
    jax.block_until_ready(big)
    print("saving", flush=True)
    ckpt.save(2, big, {"global_step": 2})
    time.sleep(60)
    """
)


def test_kill_9_during_save_leaves_previous_checkpoint(tmp_path):
    proc = subprocess.Popen(
        [sys.executable, "-c", SAVER, str(tmp_path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    assert proc.stdout.readline().strip() == "saving"
    deadline = time.monotonic() + 60
    while not any("tmp" in name for name in os.listdir(tmp_path)):  # the save has begun
        assert time.monotonic() < deadline, os.listdir(tmp_path)
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=60)
    ckpt = Checkpointer(str(tmp_path), max_to_keep=2)
    assert ckpt.steps() == [1]
    step, state, meta = ckpt.restore({"w": jnp.zeros((4,))})
    assert step == 1 and meta == {"global_step": 1}
    np.testing.assert_array_equal(state["w"], np.ones(4))
    assert ckpt.save(2, {"w": jnp.full((4,), 2.0)}, {"global_step": 2})  # resumable
    ckpt.wait()
    assert ckpt.steps() == [1, 2]
    ckpt.close()
