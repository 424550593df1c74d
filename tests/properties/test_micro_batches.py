"""Properties of the update's micro-batch split and merge (`hybridjax.training.update`):
merge ∘ split is the identity, each chunk holds the rows r ≡ i (mod chunks) in order (so a
chunk keeps the batch axis's sharding).
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

# the update's own split and merge: the micro-batches a mini-batch is cut into
from hybridjax.training.update import _merge as merge
from hybridjax.training.update import _split as split

FAST = settings(max_examples=25, deadline=None)


@st.composite
def batches(draw):
    chunks = draw(st.sampled_from([1, 2, 3, 4]))
    rows = chunks * draw(st.sampled_from([1, 2, 3]))
    trailing = draw(st.sampled_from([(), (3,)]))
    x = np.arange(rows * int(np.prod(trailing)), dtype=np.int32).reshape(rows, *trailing)
    return x, chunks


@FAST
@given(batch=batches())
def test_split_deals_rows_round_robin_and_merge_undoes_it(batch):
    x, chunks = batch
    y = split(jnp.asarray(x), chunks)
    assert y.shape == (chunks, x.shape[0] // chunks, *x.shape[1:])
    for i in range(chunks):  # chunk i: rows i, i + chunks, i + 2·chunks, ...
        np.testing.assert_array_equal(np.asarray(y[i]), x[i::chunks])
    np.testing.assert_array_equal(np.asarray(merge(y)), x)  # merge ∘ split = identity
