"""The documentation cannot go stale: the site builds strictly, its snippets run or import, and
every module, command, config key and file it names exists.

Pages are README.md and docs/*.md. A ```python block right after a `<!-- run -->` line is
executed (all such blocks of a page in order, in one fresh interpreter, as a reader would run
them); every other ```python block must compile and its `hybridjax` / `experiments` imports must
resolve. Inline code and code blocks are scanned for `python -m <module>`, dotted
`hybridjax.<...>` names, repository paths (`configs/...`, `hybridjax/...`, `experiments/...`,
`tests/...`, `notebooks/...`, `docs/...`) and dotted config keys (`data.train_batch_size`).
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import os
import re
import subprocess
import sys
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = sorted([ROOT / "README.md", *(ROOT / "docs").glob("*.md")])
IDS = [str(p.relative_to(ROOT)) for p in PAGES]

FENCE = re.compile(r"^```(\w*)\n(.*?)^```$", re.M | re.S)
RUN_MARK = "<!-- run -->"
INLINE = re.compile(r"(?<!`)`([^`\n]+)`(?!`)")
PYTHON_M = re.compile(r"python3? -m ([A-Za-z_][\w.]*)")
DOTTED = re.compile(r"^(hybridjax(?:\.[A-Za-z_]\w*)+)(?:\(.*\))?$")
PATH = re.compile(
    r"(?<![\w./-])((?:configs|hybridjax|experiments|tests|notebooks|docs)/[\w./-]*\w)"
)
SECTIONS = (
    "data|actor_rollout_ref|critic|reward_model|custom_reward_function|algorithm|trainer|mesh"
)
CONFIG_KEY = re.compile(rf"^((?:{SECTIONS})(?:\.[a-z_][a-z0-9_]*)+)(?:=.*)?$")
# columns of verl's parquet schema, named like config keys
PARQUET_FIELDS = ("reward_model.ground_truth", "reward_model.style")
# written by a command the docs show, or git-ignored: named, never committed
GENERATED = (
    "experiments/peers/.venvs",
    "experiments/peers/.work",
    "hybridjax/assets/quickstart/data/sft.parquet",
)


def _env() -> dict[str, str]:
    return {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "JAX_PLATFORMS": "cpu",
        "NO_MKDOCS_2_WARNING": "1",
    }


def _blocks(text: str) -> list[tuple[str, str, bool]]:
    """(language, body, marked to run) for every fenced block."""
    return [
        (m.group(1), m.group(2), text[: m.start()].rstrip().endswith(RUN_MARK))
        for m in FENCE.finditer(text)
    ]


def _inline(text: str) -> list[str]:
    return INLINE.findall(FENCE.sub("", text))


@cache
def _reference():
    """docs/_hooks/config_reference.py, the generator of the configuration reference."""
    spec = importlib.util.spec_from_file_location(
        "config_reference", ROOT / "docs" / "_hooks" / "config_reference.py"
    )
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclass looks its module up
    spec.loader.exec_module(module)
    return module


@cache
def _schema_keys() -> frozenset[str]:
    """Every config key and every group prefix of one, from the schemas the docs generate from."""
    module = _reference()
    keys = set(PARQUET_FIELDS)
    for schema in module.schemas():
        for key, _ in module.leaves(schema.build()):
            parts = key.split(".")
            keys.update(".".join(parts[:i]) for i in range(1, len(parts) + 1))
    return frozenset(keys)


def _resolves(dotted: str) -> bool:
    """`a.b.c` names a module, or an attribute chain of the longest importable module prefix."""
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        try:
            for attr in parts[i:]:
                obj = getattr(obj, attr)
        except AttributeError:
            return False
        return True
    return False


@pytest.mark.parametrize("page", PAGES, ids=IDS)
def test_python_snippets_compile_and_import(page):
    problems = []
    for lang, body, _ in _blocks(page.read_text()):
        if lang != "python":
            continue
        try:
            tree = ast.parse(body)
        except SyntaxError as e:
            problems.append(f"does not compile: {e}\n{body}")
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [f"{node.module}.{a.name}" for a in node.names if a.name != "*"]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                continue
            for name in names:
                if name.split(".")[0] in ("hybridjax", "experiments") and not _resolves(name):
                    problems.append(f"imports {name}, which does not exist")
    assert not problems, f"{page.name}:\n" + "\n".join(problems)


def _run_blocks(page: Path) -> list[str]:
    return [body for lang, body, run in _blocks(page.read_text()) if run and lang == "python"]


RUN_PAGES = [p for p in PAGES if _run_blocks(p)]


@pytest.mark.parametrize("page", RUN_PAGES, ids=[str(p.relative_to(ROOT)) for p in RUN_PAGES])
def test_marked_snippets_run(page, tmp_path):
    code = _run_blocks(page)
    script = tmp_path / "snippets.py"
    script.write_text("\n\n".join(code))
    result = subprocess.run(
        [sys.executable, str(script)], cwd=ROOT, env=_env(), capture_output=True, text=True
    )
    assert result.returncode == 0, f"{page.name}: a snippet failed\n{result.stderr[-3000:]}"


@pytest.mark.parametrize("page", PAGES, ids=IDS)
def test_named_modules_files_and_keys_exist(page):
    text = page.read_text()
    code = "\n".join(body for _, body, _ in _blocks(text))
    inline = _inline(text)
    problems = []
    for module in sorted(set(PYTHON_M.findall(text))):
        if importlib.util.find_spec(module) is None:
            problems.append(f"`python -m {module}`: no such module")
    for span in inline:
        m = DOTTED.match(span)
        if m and not _resolves(m.group(1)):
            problems.append(f"`{span}`: no such module or attribute")
        m = CONFIG_KEY.match(span)
        if m and m.group(1) not in _schema_keys():
            problems.append(f"`{span}`: no such config key")
    for path in sorted(set(PATH.findall(code + "\n" + "\n".join(inline)))):
        if "<" in path or path.startswith(GENERATED):
            continue
        if not (ROOT / path).exists():
            problems.append(f"{path}: no such file or directory")
    assert not problems, f"{page.name}:\n" + "\n".join(problems)


def test_readme_links_into_the_docs_exist():
    text = (ROOT / "README.md").read_text()
    targets = re.findall(r"\]\((docs/[^)#]+)(?:#[^)]*)?\)", text)
    assert targets, "the README links into docs/"
    missing = [t for t in targets if not (ROOT / t).exists()]
    assert not missing, f"README.md links to missing pages: {missing}"


def test_configuration_reference_lists_every_key_with_its_checks():
    module = _reference()
    rl, sft, dpo = module.schemas()
    markdown = "\n".join(module.schema_markdown(rl))
    rows = {line.split("`")[1]: line for line in markdown.splitlines() if line.startswith("| `")}
    assert set(rows) == {key for key, _ in module.leaves(rl.build())}
    assert "one of ('error', 'left', 'right', 'middle')" in rows["data.truncation"]
    assert "`512`" in rows["data.max_prompt_length"]  # the default
    assert "multi-turn rollouts with tools" in rows["actor_rollout_ref.rollout.multi_turn.enable"]
    assert "auto | jnp | pallas" in rows["actor_rollout_ref.rollout.attention_impl"].replace(
        "\\|", "|"
    )
    full = module.reference_markdown()
    for schema in (sft, dpo):
        assert f"## {schema.title}: `{schema.command}`" in full
    assert "| `dpo.beta` | `0.1` |" in full


def test_site_builds_strictly(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path)],
        cwd=ROOT,
        env=_env(),
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    page = (tmp_path / "configuration" / "index.html").read_text()
    assert "data.train_batch_size" in page  # the generated reference is in the built page
