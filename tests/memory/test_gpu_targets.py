"""Compile-only GPU targets: the shipped A100/H100 figures, the one-line install hint without
JAX's CUDA plugin, and backend choices that follow the mesh's devices, not the process."""

import subprocess
import sys

import jax
import pytest
from jax.sharding import Mesh

from hybridjax.memory import gpu_targets
from hybridjax.models.attention import attention_backend
from hybridjax.platforms import platform_of
from hybridjax.rollout.decode_attention import select_decode_kernel
from hybridjax.sharding.mesh import pass_mesh
from tests.rl.tiny_run import REPO


def test_targets_carry_nvidias_figures():
    a100 = gpu_targets.TARGETS["a100"].proto((12, 9, 0), (9, 28, 0))
    for field in (
        "core_count: 108",
        "cuda_compute_capability { major: 8 minor: 0 }",
        "memory_bandwidth: 2039000000000",
        "l2_cache_size: 41943040",
        "shared_memory_per_core: 167936",
        f"device_memory_size: {80 * 2**30}",
        'platform_name: "CUDA"',
        "runtime_version { major: 12 minor: 9 patch: 0 }",
    ):
        assert field in a100, field
    h100 = gpu_targets.TARGETS["h100"].proto((12, 9, 0), (9, 28, 0))
    assert "core_count: 132" in h100 and "major: 9 minor: 0" in h100


def test_without_the_plugin_the_target_says_what_to_install(monkeypatch):
    monkeypatch.setattr(gpu_targets, "installed_plugin", lambda: None)
    problem = gpu_targets.missing_plugin("a100")
    assert problem is not None and "\n" not in problem
    assert "pip install 'hybridjax[gpu-aot]'" in problem
    with pytest.raises(ValueError, match="gpu-aot"):
        gpu_targets.target_config("a100")
    with pytest.raises(ValueError, match="unknown GPU target 'v100'"):
        gpu_targets.target_config("v100")


@pytest.mark.skipif(gpu_targets.installed_plugin() is not None, reason="the plugin is installed")
def test_the_cli_exits_with_the_install_line():
    cmd = [sys.executable, "-m", "hybridjax.plan", "--config=configs/tiny.py", "--target=h100"]
    out = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert out.returncode == 1
    assert out.stderr.strip().splitlines()[-1] == gpu_targets.missing_plugin("h100")


def test_cpu_devices_choose_cpu_paths():
    mesh = Mesh(jax.devices()[:2], ("data",))
    assert platform_of(mesh) == platform_of(jax.devices()) == "cpu"
    seen = []
    with pass_mesh(mesh):  # read while tracing
        jax.jit(lambda: seen.append(attention_backend())).lower()
    assert seen == ["jnp"]
    with pytest.raises(ValueError, match="needs a GPU"):
        select_decode_kernel("pallas", None, platform_of(mesh))


def test_compile_only_gpus_choose_gpu_paths_from_a_cpu_process():
    if problem := gpu_targets.missing_plugin("h100"):
        pytest.skip(problem)
    mesh = Mesh(gpu_targets.compile_only_devices("h100", 2), ("data",))
    assert jax.default_backend() == "cpu" and platform_of(mesh) == "gpu"
    seen = []
    with pass_mesh(mesh):
        jax.jit(lambda: seen.append(attention_backend())).lower()
    assert seen == ["blocked"]
    assert select_decode_kernel("pallas", None, platform_of(mesh)) == "pallas"


def test_a_stage_xla_gpu_cannot_compile_does_not_fit_and_names_the_key():
    from configs.tiny import get_config
    from hybridjax.memory import planner as plan

    c = get_config()
    c.reward_model.model.use_remove_padding = True
    stages = (plan.StagePlan("reward", {"reward model params": 10}),)
    error = {"error": "UNKNOWN: 'scf.if' op along control flow edge"}
    p = plan.MemoryPlan(8, 100, stages, 1, 1, 10**6, (), xla_gpu={"reward": error})  # type: ignore[dict-item]
    assert not p.fits  # 10 bytes counted, but it cannot run
    mesh = jax.make_mesh((1, 1, 8, 1), ("data", "expert", "fsdp", "tensor"))
    (advice,) = plan.advise(p, c, mesh, 8)
    assert "reward_model.model.use_remove_padding=False" in advice
    assert "XLA:GPU cannot compile reward: UNKNOWN" in p.report()
