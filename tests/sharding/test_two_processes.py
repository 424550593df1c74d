"""Two CPU processes × 4 devices (jax.distributed, gloo on localhost) = one process × 8 devices."""

import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from two_process_worker import relayout_and_forward

WORKER = Path(__file__).with_name("two_process_worker.py")
REPO = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_two_processes_match_one_process(tmp_path):
    port = _free_port()
    env = {**os.environ, "PYTHONPATH": str(REPO), "JAX_PLATFORMS": "cpu"}
    procs = [
        subprocess.Popen(
            [sys.executable, str(WORKER), str(i), str(port), str(tmp_path)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for i in range(2)
    ]
    expected = relayout_and_forward()  # 8 devices in this process, while the workers run
    outputs = [p.communicate(timeout=600)[0] for p in procs]
    for p, out in zip(procs, outputs, strict=True):
        assert p.returncode == 0, out[-3000:]
    for i in range(2):
        got = np.load(tmp_path / f"process_{i}.npz")
        assert set(got.files) == set(expected)
        assert float(got["roundtrip_error"]) == 0.0
        assert int(got["nbytes"]) == int(expected["nbytes"])
        np.testing.assert_allclose(got["logits"], expected["logits"], rtol=0, atol=1e-6)
        for key in expected:
            if key.startswith("gen_"):
                np.testing.assert_array_equal(got[key], expected[key])
