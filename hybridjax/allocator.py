"""The device memory budget: the fraction of each GPU that JAX's allocator may take.

JAX preallocates 75% of a GPU by default (`XLA_PYTHON_CLIENT_MEM_FRACTION`), so an 80 GB
device gives a run 60 GB. `trainer.device_memory_fraction` (default 0.9) sets it before JAX
starts its backend; a value the user already put in the environment wins. The engine's KV
pool (`gpu_memory_utilization` of what is free), `trainer.check_memory` (the device's
`bytes_limit`) and the planner (`--device_memory_gb` × this fraction) then size against the
same budget. CPU backends ignore it.
"""

from __future__ import annotations

import os

ENV = "XLA_PYTHON_CLIENT_MEM_FRACTION"


def memory_fraction(configured: float) -> float:
    """The fraction in effect: the environment's `XLA_PYTHON_CLIENT_MEM_FRACTION` if set, else
    `configured`. Raises ValueError naming the source when it is not in (0, 1]."""
    source, value = (ENV, os.environ[ENV]) if ENV in os.environ else ("fraction", configured)
    try:
        fraction = float(value)
    except ValueError:
        raise ValueError(f"{source}={value!r}: not a number") from None
    if not 0 < fraction <= 1:
        raise ValueError(f"{source}={value!r}: must be in (0, 1]")
    return fraction


def set_allocator_fraction(configured: float) -> float:
    """Puts `configured` into the environment unless the user set it; returns the fraction in
    effect. Call before JAX starts its backend (the first device query)."""
    fraction = memory_fraction(configured)
    os.environ.setdefault(ENV, str(fraction))
    return fraction
