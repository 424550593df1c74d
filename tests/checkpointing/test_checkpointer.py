"""Orbax checkpoints: sharded round trip, keep-N, NaN refusal, checksums verified at restore,
unreadable steps skipped but never touched, structure mismatches named, read-only use, and a
process killed (SIGKILL) in the middle of a save leaves the previous step loadable."""

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
from hybridjax.errors import CheckpointError


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


def _tree_bytes(path) -> dict[str, bytes]:
    out = {}
    for root, _, files in os.walk(path):
        for name in files:
            with open(os.path.join(root, name), "rb") as f:
                out[os.path.relpath(os.path.join(root, name), path)] = f.read()
    return out


def _saved(tmp_path, steps=(1, 2), **kw) -> Checkpointer:
    ckpt = Checkpointer(str(tmp_path), max_to_keep=3, **kw)
    for step in steps:
        state = _state(step)
        state["big"] = jnp.arange(20_000, dtype=jnp.float32) * step  # incompressible-ish
        ckpt.save(step, state, {"global_step": step})
    ckpt.wait()
    return ckpt


def _target():
    state = _state(0.0)
    state["big"] = jnp.zeros(20_000, jnp.float32)
    return state


def _largest_array_file(step_dir) -> str:
    files = [os.path.join(r, n) for r, _, fs in os.walk(step_dir / "state") for n in fs]
    return max(files, key=os.path.getsize)


def test_unreadable_newest_step_is_skipped_and_kept_untouched(tmp_path, caplog):
    _saved(tmp_path).close()
    for root, _, files in os.walk(tmp_path / "global_step_2" / "state"):
        for name in files:
            os.remove(os.path.join(root, name))
    before = _tree_bytes(tmp_path)
    fresh = Checkpointer(str(tmp_path), max_to_keep=3)
    step, state, _ = fresh.restore(_target())
    assert step == 1 and float(np.asarray(state["w"])[0, 0]) == 1.0
    assert "global_step_2" in caplog.text and "unreadable" in caplog.text
    assert _tree_bytes(tmp_path) == before  # nothing renamed, deleted or written
    assert not fresh.save(1, _state(5.0), {"global_step": 1})  # a readable step is kept
    again = _target()
    assert fresh.save(2, again, {"global_step": 2})  # the run reached step 2 again
    fresh.wait()
    names = sorted(os.listdir(tmp_path))
    assert names == ["global_step_1", "global_step_2", "global_step_2.unreadable"]
    assert fresh.restore(_target())[0] == 2
    fresh.close()


def test_every_checkpoint_unreadable_is_an_error_naming_each(tmp_path):
    """Not a fresh start over a run's checkpoints: one message naming every file and why."""
    _saved(tmp_path).close()
    victims = [_largest_array_file(tmp_path / f"global_step_{s}") for s in (1, 2)]
    for victim in victims:
        with open(victim, "r+b") as f:
            f.write(os.urandom(64))
    before = _tree_bytes(tmp_path)
    ckpt = Checkpointer(str(tmp_path), max_to_keep=3, read_only=True)
    with pytest.raises(CheckpointError, match=f"every checkpoint in {tmp_path} is unreadable") as e:
        ckpt.restore(_target())
    ckpt.close()
    for victim in victims:
        assert f"{victim}: checksum mismatch" in str(e.value)
    assert "trainer.resume_mode=disable" in str(e.value)
    assert _tree_bytes(tmp_path) == before
    assert Checkpointer(str(tmp_path / "new"), 1).restore(_target()) is None  # no checkpoint


def test_checksum_mismatch_falls_back_and_names_the_file(tmp_path, caplog):
    _saved(tmp_path).close()
    assert (tmp_path / "global_step_2" / "checksums.json").is_file()
    victim = _largest_array_file(tmp_path / "global_step_2")
    with open(victim, "r+b") as f:  # 64 bytes inside the array data, file size unchanged
        f.seek(os.path.getsize(victim) // 2)
        f.write(os.urandom(64))
    before = _tree_bytes(tmp_path)
    ckpt = Checkpointer(str(tmp_path), max_to_keep=3, read_only=True)
    step, state, _ = ckpt.restore(_target())
    assert step == 1 and float(np.asarray(state["big"])[3]) == 3.0
    assert f"{victim}: checksum mismatch" in caplog.text
    assert _tree_bytes(tmp_path) == before
    with pytest.raises(CheckpointError, match="global_step_2 is unreadable: .*checksum mismatch"):
        ckpt.restore(_target(), step=2)  # an explicit step never falls back
    ckpt.close()


def test_mismatched_structure_stops_with_every_difference(tmp_path):
    _saved(tmp_path).close()
    before = _tree_bytes(tmp_path)
    target = _target()
    target["w"] = jnp.zeros((16, 8))
    target["big"] = jnp.zeros(20_000, jnp.bfloat16)
    target["extra"] = jnp.zeros(3)
    del target["step"]
    ckpt = Checkpointer(str(tmp_path), max_to_keep=3)
    with pytest.raises(CheckpointError) as err:
        ckpt.restore(target)
    message = str(err.value)
    assert "global_step_2 does not match this config (4 differences)" in message
    assert "w: shape (16, 4) in the checkpoint, (16, 8) in this config" in message
    assert "big: dtype float32 in the checkpoint, bfloat16 in this config" in message
    assert "extra: not in the checkpoint" in message and "step: in the checkpoint" in message
    assert "trainer.resume_mode=disable" in message
    meta_check = lambda meta: [f"global_step is {meta['global_step']}"]  # noqa: E731
    with pytest.raises(CheckpointError, match="global_step is 2"):
        ckpt.restore(_target(), check_meta=meta_check)
    ckpt.close()
    assert _tree_bytes(tmp_path) == before


def test_non_finite_restored_state_is_unreadable(tmp_path, monkeypatch, caplog):
    ckpt = _saved(tmp_path)
    from hybridjax.checkpointing import manager

    real = manager.all_finite
    monkeypatch.setattr(manager, "all_finite", lambda tree: real(tree) and "big" not in tree)
    with pytest.raises(CheckpointError, match="global_step_1 .the restored state contains NaN"):
        ckpt.restore(_target())  # every step is unreadable
    assert "contains NaN or inf" in caplog.text
    ckpt.close()


def test_read_only_never_creates_the_directory(tmp_path):
    missing = tmp_path / "nothing" / "here"
    ckpt = Checkpointer(str(missing), max_to_keep=2, read_only=True)
    assert ckpt.restore(_target()) is None
    with pytest.raises(CheckpointError, match=r"global_step_3 is not a checkpoint .*none"):
        ckpt.restore(_target(), step=3)
    ckpt.close()
    assert not (tmp_path / "nothing").exists()


def test_split_checkpoint_path():
    assert split_checkpoint_path("/a/b/global_step_12/") == ("/a/b", 12)
    with pytest.raises(CheckpointError, match="trainer.resume_mode: .*'auto', 'disable'"):
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
