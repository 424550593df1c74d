"""The GPU check's report as text: one table per step, and a line for each step that was
skipped or failed, with why (`format_step`); `format_report` for a whole `check.json`."""

from __future__ import annotations


def _cell(value) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return "" if value is None else str(value)


def format_table(table: dict) -> str:
    """A step's table (`{"title", "columns", "rows"}`) as aligned plain text; a short row (a
    kernel skipped, with why) leaves its last cells empty."""
    n = len(table["columns"])
    rows = [
        [_cell(v) for v in [*row, *[""] * (n - len(row))]]
        for row in [table["columns"], *table["rows"]]
    ]
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join([f"  {table['title']}", *(f"    {line}" for line in lines)])


def status_line(result: dict) -> str:
    """`[step] ok (12.3 s)`, or `[step] skipped: why` / `[step] failed: why`."""
    status, seconds = result.get("status", "missing"), result.get("seconds")
    took = f" ({seconds:.1f} s)" if isinstance(seconds, int | float) else ""
    why = f": {result['why']}" if result.get("why") else ""
    return f"[{result.get('step', '?')}] {status}{took}{why}"


def format_step(result: dict) -> str:
    """The status line of one step's JSON, then its tables."""
    return "\n".join([status_line(result), *map(format_table, result.get("tables", []))])


def format_report(report: dict) -> str:
    """Every step of a `check.json` (`{"steps": {name: result}}`), in run order."""
    return "\n\n".join(format_step(r) for r in report.get("steps", {}).values())
