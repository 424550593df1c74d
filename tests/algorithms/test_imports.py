"""The modules of `hybridjax.algorithms` import each other one way, counting imports under
`if TYPE_CHECKING:` too (`registry` ← `config` ← `advantages`, `losses`, `kl`, ...); that the
whole package has no cycle is `tests/test_import_layers.py`."""

from experiments.import_graph import import_graph


def test_algorithm_modules_import_one_way():
    graph = import_graph()
    algorithms = "hybridjax.algorithms."
    assert graph[algorithms + "registry"] == set()
    assert not graph[algorithms + "config"] & {
        algorithms + m for m in ("advantages", "losses", "kl")
    }
    assert all(m.startswith(algorithms) for m in graph[algorithms + "losses"])
