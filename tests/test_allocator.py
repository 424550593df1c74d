"""The allocator's fraction (`hybridjax.allocator`): the config's value unless the user's
environment sets one; bad values name their source."""

import pytest

from hybridjax import allocator


def test_config_fraction_is_set_unless_the_environment_has_one(monkeypatch):
    monkeypatch.delenv(allocator.ENV, raising=False)
    assert allocator.set_allocator_fraction(0.9) == 0.9
    assert allocator.os.environ[allocator.ENV] == "0.9"
    monkeypatch.setenv(allocator.ENV, "0.6")
    assert allocator.set_allocator_fraction(0.9) == 0.6
    assert allocator.os.environ[allocator.ENV] == "0.6"


@pytest.mark.parametrize("env, configured, message", [
    (None, 1.5, "fraction=1.5: must be in"),
    ("lots", 0.9, "XLA_PYTHON_CLIENT_MEM_FRACTION='lots': not a number"),
    ("0", 0.9, "XLA_PYTHON_CLIENT_MEM_FRACTION='0': must be in"),
])  # fmt: skip
def test_bad_fractions_name_their_source(monkeypatch, env, configured, message):
    monkeypatch.delenv(allocator.ENV, raising=False)
    if env is not None:
        monkeypatch.setenv(allocator.ENV, env)
    with pytest.raises(ValueError, match=message):
        allocator.memory_fraction(configured)
