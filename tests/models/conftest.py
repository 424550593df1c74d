"""Session fixtures: one tiny HF checkpoint per family, and a left-padded batch."""

import numpy as np
import pytest
from hf_testing import FAMILIES, VOCAB, write_hf_model


@pytest.fixture(scope="session")
def hf_checkpoints(tmp_path_factory):
    """family -> (checkpoint dir, HF model): one tiny causal LM per family, written once."""
    out = {}
    for family, make in FAMILIES.items():
        config, cls = make()
        path = tmp_path_factory.mktemp(f"hf_{family}")
        out[family] = (path, write_hf_model(path, cls, config))
    return out


@pytest.fixture(scope="session")
def padded_batch():
    """(ids, mask, positions), int numpy B×T: 3 left-padded rows of lengths 20, 13 and 5."""
    b, t, lengths = 3, 20, (20, 13, 5)
    rng = np.random.default_rng(0)
    mask = np.zeros((b, t), np.int64)
    for row, n in enumerate(lengths):
        mask[row, t - n :] = 1
    ids = rng.integers(1, VOCAB, (b, t)) * mask  # pad id 0 only at padding
    positions = np.maximum(np.cumsum(mask, axis=1) - 1, 0)
    return ids, mask, positions
