"""Why a long-lived test process crashed inside XLA:CPU: memory maps, not memory.

Every XLA:CPU executable a process keeps alive holds memory mappings of its own (LLVM's JIT
sections for code, read-only and read-write data, for each piece of the parallel codegen
split): about 33 for a small program of a few fused layers, 3 for a one-op program. Linux caps
the mappings of one process at `vm.max_map_count` (65,530 by default). When the compiled
programs of a process near that cap, XLA cannot map the next program's sections and does not
fail cleanly: the process dies with SIGSEGV while compiling or serializing an executable for the
persistent compilation cache, or LLVM aborts it ("Unable to allocate section memory!",
SIGABRT). That is
the slow suite's old crash "inside XLA's CPU compiler or serializer" after 25 minutes of
programs piling up in one process, in a test that passes alone.

This script reproduces it in seconds: it takes the process's maps to `SPARE` below the cap with
anonymous one-page maps (alternating protections, so the kernel cannot merge them), then
compiles distinct programs (and, with `--serialize`, serializes each as the cache does) until
the process dies. It prints the map count after each program.

    python experiments/xla_memory_maps.py                # SIGSEGV (exit 139)
    python experiments/xla_memory_maps.py --spare 300    # LLVM ERROR, SIGABRT (exit 134)
    python experiments/xla_memory_maps.py --serialize

Measured on JAX 0.10.2 (CPU), `vm.max_map_count` 65,530: 33 maps per program; with 2,000 maps
spare the process died at its 60th program (59th with `--serialize`), with SIGSEGV.
What keeps the test suite clear of it: `tests/conftest.py` drops the compiled programs after
every test file (`jax.clear_caches()`), and the slow suite's workers are replaced every 300 s
(`tests/worker_recycling.py`).
"""

from __future__ import annotations

import argparse
import mmap


def maps() -> int:
    """The memory mappings this process holds (lines of /proc/self/maps)."""
    with open("/proc/self/maps") as f:
        return sum(1 for _ in f)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--spare", type=int, default=2000, help="maps left below the cap")
    parser.add_argument("--serialize", action="store_true", help="serialize each executable")
    args = parser.parse_args()

    import jax
    import jax.numpy as jnp

    with open("/proc/sys/vm/max_map_count") as f:
        limit = int(f.read())
    x, w = jnp.ones((8, 64)), jnp.ones((64, 64))
    jax.jit(lambda a: a + 1)(x).block_until_ready()  # the backend's own maps first
    held: list[mmap.mmap] = []
    while maps() < limit - args.spare:
        for _ in range(min(1000, max(1, limit - args.spare - maps()))):
            prot = mmap.PROT_READ if len(held) % 2 else mmap.PROT_READ | mmap.PROT_WRITE
            held.append(mmap.mmap(-1, mmap.PAGESIZE, prot=prot))
    print(f"maps {maps()} of vm.max_map_count {limit}", flush=True)

    programs = []
    for i in range(limit):

        def layers(x, w, i=i):
            for _ in range(6):
                x = jnp.tanh(x @ w + i) * jnp.sum(x, axis=-1, keepdims=True)
            return jax.nn.log_softmax(x)

        compiled = jax.jit(layers).lower(x, w).compile()
        programs.append(compiled)
        executable = compiled.runtime_executable()
        if args.serialize and executable is not None:
            executable.serialize()
        print(f"program {i}: maps {maps()}", flush=True)


if __name__ == "__main__":
    main()
