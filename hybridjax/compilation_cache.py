"""The persistent compilation cache: a restarted run loads its compiled programs from disk.

JAX compiles every jitted program of a run when it first runs (for a 7B model, minutes of the
first step). With a cache directory set, XLA's executables are written there, keyed on the
program, the JAX version, the devices and the flags, and a later run of the same config loads
them instead of compiling. `trainer.compilation_cache_dir` (default `auto`: `jax/` under the
user's cache directory, `platformdirs.user_cache_dir("hybridjax")` when platformdirs is
installed, else `~/.cache/hybridjax`; `""` turns the cache off) is applied through
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


def cache_dir(configured: str) -> str:
    """The cache directory in effect: the environment's `JAX_COMPILATION_CACHE_DIR` if set,
    else `configured` (`auto`: `default_cache_dir()`; `""`: none, the cache is off; a path,
    `~` expanded)."""
    if ENV in os.environ:
        return os.environ[ENV]
    if configured == AUTO:
        return default_cache_dir()
    return os.path.expanduser(configured)


def set_compilation_cache(configured: str) -> str:
    """Points JAX's persistent compilation cache at `cache_dir(configured)` unless the user's
    environment already did; returns the directory in effect ("" = off). Call before the first
    compile: JAX opens the cache once."""
    import jax

    path = cache_dir(configured)
    if ENV not in os.environ and path:
        jax.config.update("jax_compilation_cache_dir", path)
    return path
