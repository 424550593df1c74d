"""What each benchmark needs beyond hybridjax's own dependencies, checked before it starts.

`pip install -e '.[bench]'` installs the libraries (torch 2.13 CPU and transformers, for the
HF baselines of `generation` and `update_cost`); the peers' own virtualenvs come from
`experiments/peers/setup_venvs.sh` (never project dependencies). A missing one stops the
benchmark with one message naming it and the command that installs it, instead of a
`ModuleNotFoundError` deep inside a run.
"""

from __future__ import annotations

import importlib.util
import pathlib

BENCH_INSTALL = "pip install -e '.[bench]'"
PEERS_SETUP = "experiments/peers/setup_venvs.sh"
PEER_VENVS = pathlib.Path(__file__).resolve().parents[1] / "peers" / ".venvs"

# benchmark -> Python modules it imports beyond hybridjax's core dependencies
MODULES = {
    "generation": ("torch", "transformers"),
    "update_cost": ("torch", "transformers"),
}


class MissingRequirement(RuntimeError):
    """A benchmark's library or peer environment is not installed (the message says how)."""


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def problems(benchmark: str, peer_systems: tuple[str, ...] = ()) -> list[str]:
    """One line per missing module of `benchmark` and per missing peer virtualenv."""
    out = [
        f"benchmark {benchmark!r} needs the {module!r} package: {BENCH_INSTALL}"
        for module in MODULES.get(benchmark, ())
        if not _installed(module)
    ]
    out += [
        f"benchmark {benchmark!r} runs the peer {system!r}, whose virtualenv "
        f"{PEER_VENVS / system} is missing: bash {PEERS_SETUP}"
        for system in peer_systems
        if system != "hybridjax" and not (PEER_VENVS / system / "bin" / "python").exists()
    ]
    return out


def require(benchmark: str, peer_systems: tuple[str, ...] = ()) -> None:
    """Raises MissingRequirement listing `problems(benchmark, peer_systems)`, if any."""
    found = problems(benchmark, peer_systems)
    if found:
        raise MissingRequirement("\n".join(found))
