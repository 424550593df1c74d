"""The persistent compilation cache: a restarted run loads its compiled programs from disk.

JAX compiles every jitted program of a run when it first runs (for a 7B model, minutes of the
first step). With a cache directory set, XLA's executables are written there, keyed on the
program, the JAX version, the devices and the flags, and a later run of the same config loads
them instead of compiling. `trainer.compilation_cache_dir` (default `auto`: on a GPU or TPU
backend `jax/` under the user's cache directory, `platformdirs.user_cache_dir("hybridjax")`
when platformdirs is installed, else `~/.cache/hybridjax`; on CPU off, because CPU programs of
our sizes compile in seconds; `""` turns the cache off, a path turns it on anywhere) is
applied through
`jax.config.update("jax_compilation_cache_dir", ...)` before the first compile, by
`python -m hybridjax.train`, `hybridjax.sft` and `hybridjax.dpo`. A `JAX_COMPILATION_CACHE_DIR`
the user already put in the environment wins (JAX read it when it was imported). JAX's own
thresholds apply: programs that took under a second to compile are not written
(`JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS`).
"""

from __future__ import annotations

import os

ENV = "JAX_COMPILATION_CACHE_DIR"
AUTO = "auto"


def default_cache_dir() -> str:
    """`<user cache dir>/jax`: platformdirs' `user_cache_dir("hybridjax")` (XDG_CACHE_HOME on
    Linux, ~/Library/Caches on macOS) when installed, else `~/.cache/hybridjax`."""
    try:
        import platformdirs
    except ImportError:
        base = os.path.join(os.path.expanduser("~"), ".cache", "hybridjax")
    else:
        base = platformdirs.user_cache_dir("hybridjax")
    return os.path.join(base, "jax")


def cache_dir(configured: str, backend: str | None = None) -> str:
    """The cache directory in effect: the environment's `JAX_COMPILATION_CACHE_DIR` if set,
    else `configured` (`auto`: `default_cache_dir()` on a GPU or TPU `backend`, "" on CPU;
    `""`: none, the cache is off; a path, `~` expanded). `backend` defaults to
    `jax.default_backend()` (which starts JAX's backends: call after `jax.distributed`)."""
    if ENV in os.environ:
        return os.environ[ENV]
    if configured == AUTO:
        import jax

        from hybridjax.models.config import ACCELERATORS

        backend = backend or jax.default_backend()
        return default_cache_dir() if backend in ACCELERATORS else ""
    return os.path.expanduser(configured)


def set_compilation_cache(configured: str) -> str:
    """Points JAX's persistent compilation cache at `cache_dir(configured)` unless the user's
    environment already did; returns the directory in effect ("" = off). Call before the first
    compile (JAX opens the cache once) and, with `auto`, after `jax.distributed.initialize`."""
    import jax

    path = cache_dir(configured)
    if ENV not in os.environ and path:
        jax.config.update("jax_compilation_cache_dir", path)
    return path
