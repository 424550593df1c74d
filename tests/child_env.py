"""The environment of a process a test starts (a CLI run, a reward server, a second host).

By default it keeps what the suite's processes share: the XLA flags `tests/conftest.py` adds
(a child compiles in about half the time, as the suite does: a 2-step run in 2 processes took 184
CPU-s with XLA's full optimisation and 134 s with them) and the persistent compilation cache's
variables. The number of simulated CPU devices is the child's own. `as_user=True` is a user's run
instead, for runs long enough that the programs' speed outweighs their compile time (the quick
start's 10 steps took 57 CPU-s that way and 63 s with the suite's flags): no XLA flags at all,
one CPU device.
"""

from __future__ import annotations

import os

_DEVICE_COUNT = "--xla_force_host_platform_device_count"


def child_env(
    devices: int | None = None, as_user: bool = False, **variables: str
) -> dict[str, str]:
    """A copy of this process's environment for a child JAX process on CPU.

    Args:
      devices: simulated CPU devices of the child (`--xla_force_host_platform_device_count`);
        None for one device.
      as_user: no XLA flags (full optimisation, one device), as a user's run on a CPU machine.
      variables: further variables to set (e.g. `PYTHONPATH`).

    Returns:
      The environment, with `JAX_PLATFORMS=cpu` and this process's `XLA_FLAGS` less any device
      count, plus the child's own.
    """
    env = dict(os.environ, JAX_PLATFORMS="cpu", **variables)
    if as_user:
        if devices is not None:
            raise ValueError("as_user runs on one CPU device: leave devices=None")
        env.pop("XLA_FLAGS", None)
        return env
    flags = [f for f in env.get("XLA_FLAGS", "").split() if not f.startswith(_DEVICE_COUNT)]
    if devices is not None:
        flags.append(f"{_DEVICE_COUNT}={devices}")
    env["XLA_FLAGS"] = " ".join(flags)
    return env
