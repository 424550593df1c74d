"""Every probe case through the command line (subprocesses sharing one tiny trained run):
each must end `clear` (exit code 2, a short message naming the key/file/row, no traceback) or
`documented` (the documented handling, checkpoint and export directories byte-identical where
nothing should change). See `tests/reliability/probe.py` for the cases."""

from __future__ import annotations

import pytest

from tests.reliability import probe

pytestmark = pytest.mark.slow


@pytest.fixture(scope="session")
def ctx(tmp_path_factory):
    return probe.prepare(tmp_path_factory.mktemp("probe"), str(probe.REPO))


@pytest.mark.parametrize("name", list(probe.CASES))
def test_case(ctx, name):
    category, detail = probe.CASES[name](ctx)
    if category == "skipped":
        pytest.skip(detail)
    assert category in ("clear", "documented"), f"{name}: {category}: {detail}"
