"""What every step of the GPU check shares: its command line, its JSON written as it goes, its
tables, and one line saying why when it is skipped or fails.

A step module defines `run(ctx: Context) -> None` and ends with `main("name", run)`; it is run
as `python -m experiments.gpu.<name> --out DIR [--dry-run]` (by `check.py`, in a subprocess
with a time limit) and writes `DIR/<name>.json`:

    {"step": name, "status": "running" | "ok" | "skipped" | "failed", "why": str,
     "seconds": float, "tables": [{"title", "columns", "rows"}], ...the step's numbers}

The file is rewritten after every table and `ctx.save`, so a step cut short by its time limit
leaves what it measured so far (status "running").
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys
import time
import traceback
from collections.abc import Callable

ROOT = pathlib.Path(__file__).resolve().parents[2]


class Skip(Exception):
    """Raised by a step that cannot run here; its message says why (one line)."""


class Context:
    """A running step: where it writes, whether it is a dry run, what it recorded so far."""

    def __init__(self, name: str, out: pathlib.Path, dry_run: bool):
        self.name, self.out, self.dry_run = name, out, dry_run
        self.start = time.perf_counter()
        self.result: dict = {"step": name, "status": "running", "dry_run": dry_run, "tables": []}
        out.mkdir(parents=True, exist_ok=True)

    @property
    def path(self) -> pathlib.Path:
        return self.out / f"{self.name}.json"

    def save(self, **fields) -> None:
        """Merges `fields` into the result and rewrites the JSON (atomically)."""
        self.result |= fields
        self.result["seconds"] = round(time.perf_counter() - self.start, 3)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.result, indent=2, default=str))
        os.replace(tmp, self.path)

    def table(self, title: str, columns: list[str], rows: list[list]) -> None:
        """Adds a table to the report (printed by `report.format_table`) and saves."""
        self.result["tables"].append({"title": title, "columns": columns, "rows": rows})
        self.save()

    def earlier(self, step: str) -> dict:
        """The JSON of an earlier step of this run (`{}` when it did not write one)."""
        path = self.out / f"{step}.json"
        return json.loads(path.read_text()) if path.is_file() else {}


def main(name: str, run: Callable[[Context], None]) -> None:
    """Command line of a step: runs `run`, records ok / skipped / failed with why, prints the
    step's tables; exits 1 when it failed."""
    from experiments.gpu.report import format_step

    parser = argparse.ArgumentParser(description=f"GPU check step {name}")
    parser.add_argument("--out", required=True, help="folder of the check's results")
    parser.add_argument("--dry-run", action="store_true", help="CPU, tiny shapes")
    args = parser.parse_args()
    ctx = Context(name, pathlib.Path(args.out), args.dry_run)
    ctx.save()
    try:
        run(ctx)
        ctx.save(status="ok")
    except Skip as why:
        ctx.save(status="skipped", why=str(why))
    except Exception as err:  # a step's failure is its report, never the check's end
        traceback.print_exc()
        first = (str(err).strip().splitlines() or [""])[0][:300]
        ctx.save(status="failed", why=f"{type(err).__name__}: {first}")
    print(format_step(ctx.result), flush=True)
    sys.exit(1 if ctx.result["status"] == "failed" else 0)
