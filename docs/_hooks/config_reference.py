"""The configuration reference page, generated from the config schemas and their checks.

An mkdocs hook (`hooks:` in mkdocs.yml): `on_page_markdown` replaces the marker
`<!-- config-reference -->` in docs/configuration.md with, for each entry point, one table per
top-level section: every key of the default config, its default, its type, the checks the
start-up validation declares for it (ranges, choices, registry names) and the comment written
beside it in the schema's source. `schemas()` is the one place that knows where the schemas
and the checks live.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import io
import tokenize
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from ml_collections import ConfigDict

MARKER = "<!-- config-reference -->"


@dataclasses.dataclass(frozen=True)
class Schema:
    """One entry point's config.

    Attributes:
      title, command: how the page names it.
      build: returns the default ConfigDict (every key the entry point accepts).
      rules: `rules() -> [(dotted key, Checked)]`, the checks declared beside the keys (ranges,
        choices, registry names; `hybridjax.config.fields`); None when it declares none.
      commented: functions whose source comments describe the keys (later ones win).
    """

    title: str
    command: str
    build: Callable[[], Any]
    rules: Callable[[], list[tuple[str, Any]]] | None
    commented: tuple[Callable[..., Any], ...]


def schemas() -> list[Schema]:
    """The RL trainer's, SFT's and DPO's configs, where they live today."""
    from hybridjax.config.schema import base_config, declared_checks, declared_config
    from hybridjax.offline.dpo import dpo_config
    from hybridjax.offline.sft import sft_config

    return [
        Schema(
            "RL training",
            "python -m hybridjax.train",
            base_config,
            declared_checks,
            (declared_config,),
        ),
        Schema("SFT", "python -m hybridjax.sft", sft_config, None, (sft_config,)),
        Schema("DPO", "python -m hybridjax.dpo", dpo_config, None, (sft_config, dpo_config)),
    ]


def _is_dict(value: Any) -> bool:
    return isinstance(value, Mapping | ConfigDict)


def leaves(cfg: Any, prefix: str = "") -> Iterator[tuple[str, Any]]:
    """(dotted key, default) for every leaf; an empty dict is a leaf (a free-form dict)."""
    for key, value in cfg.items():
        path = f"{prefix}{key}"
        if _is_dict(value) and len(value) > 0:
            yield from leaves(value, path + ".")
        else:
            yield path, value


def source_comments(fn: Callable[..., Any]) -> dict[str, str]:
    """Dotted key -> the comment beside it (trailing) or just above it in `fn`'s source.

    Reads `c.<section> = dict(key=value, ...)` assignments and nested `dict(...)` calls (and
    helpers returning `dict(...)` called from them, such as the optimizer block).
    A key the parse does not reach has no comment; the reference stays complete without it.
    """
    module = inspect.getmodule(fn)
    text = inspect.getsource(module) if module else ""
    tree = ast.parse(text)
    trailing, alone = _comments(text)
    helpers = {n.name: n for n in tree.body if isinstance(n, ast.FunctionDef)}
    notes: dict[str, str] = {}

    def note(line: int, seen: set[int]) -> str:
        """The comments of `line`, for the first key written on it (per walk)."""
        if line in seen:
            return ""
        seen.add(line)
        block: list[str] = []
        above = line - 1
        while above in alone:
            block.insert(0, alone[above])
            above -= 1
        return " ".join(block + ([trailing[line]] if line in trailing else []))

    def visit(call: ast.AST, prefix: str, seen: set[int]) -> None:
        if not isinstance(call, ast.Call) or not isinstance(call.func, ast.Name):
            return
        if call.func.id in helpers:  # each call of a helper reads its comments afresh
            for ret in ast.walk(helpers[call.func.id]):
                if isinstance(ret, ast.Return) and ret.value is not None:
                    visit(ret.value, prefix, set())
            return
        if call.func.id == "ConfigDict" and call.args:
            visit(call.args[0], prefix, seen)
            return
        if call.func.id != "dict":  # a checked field (`positive(8)`) is a leaf
            return
        for kw in call.keywords:
            if kw.arg is None:
                continue
            path = prefix + kw.arg
            if text := note(kw.lineno, seen):
                notes[path] = text
            visit(kw.value, path + ".", seen)

    fn_node = helpers.get(fn.__name__)
    for node in ast.walk(fn_node) if fn_node else ():
        if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Attribute):
            section, seen = node.targets[0].attr, set[int]()
            if text := note(node.lineno, seen):
                notes[section] = text
            visit(node.value, section + ".", seen)
    return notes


def _comments(text: str) -> tuple[dict[int, str], dict[int, str]]:
    """Line -> comment text, for trailing comments and for comment-only lines."""
    trailing, alone = {}, {}
    lines = text.splitlines()
    for tok in tokenize.generate_tokens(io.StringIO(text).readline):
        if tok.type == tokenize.COMMENT:
            line = tok.start[0]
            body = tok.string.lstrip("#").strip()
            if lines[line - 1].strip().startswith("#"):
                alone[line] = body
            else:
                trailing[line] = body
    return trailing, alone


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _default(value: Any) -> str:
    if _is_dict(value):
        return "`{}`"
    return f"`{value!r}`"


def schema_markdown(schema: Schema) -> list[str]:
    """`## <title>` and, per top-level section, `### <section>` with a table of its keys."""
    cfg = schema.build()
    checks: dict[str, list[str]] = {}
    for key, field in schema.rules() if schema.rules else ():
        checks.setdefault(key, []).append(field.rule)
    notes: dict[str, str] = {}
    for fn in schema.commented:
        notes.update(source_comments(fn))
    out = [f"## {schema.title}: `{schema.command}`", ""]
    for section in cfg:
        out += [f"### `{section}`", ""]
        if notes.get(section):
            out += [_cell(notes[section]), ""]
        out += ["| key | default | type | checked at start | note |", "|---|---|---|---|---|"]
        value = cfg[section]
        rows = leaves(value, section + ".") if _is_dict(value) else [(section, value)]
        shown = {section}
        for key, default in rows:
            group = key.rsplit(".", 1)[0]
            note = notes.get(key, "")
            if group not in shown and notes.get(group):  # a group's note, on its first row
                note = f"{notes[group]} {note}".strip()
            shown.add(group)
            out.append(
                f"| `{key}` | {_cell(_default(default))} | {type(default).__name__} | "
                f"{_cell('; '.join(checks.get(key, [])))} | {_cell(note)} |"
            )
        out.append("")
    return out


def reference_markdown() -> str:
    """The generated reference of every entry point."""
    return "\n".join(line for schema in schemas() for line in schema_markdown(schema))


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    """mkdocs hook: fill the marker of the configuration page."""
    if MARKER not in markdown:
        return markdown
    return markdown.replace(MARKER, reference_markdown())
