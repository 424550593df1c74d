"""What stays on the devices between stages: the rollout engine sleeps after `gen` (verl's
`rollout.free_cache_engine`, vLLM's sleep mode).

After `gen` the KV page pool is deleted, and so are the generation copy of the weights when
they are the engine's own buffers (a re-layout or a cast of the actor's). When the rollout
reads the actor's very arrays (same layout and dtype: the re-layout forwards them), only the
pool goes: deleting those would delete the actor. `reshard` then writes the next copy into
a sleeping engine (one generation copy at a time) and the next `prefill` rebuilds the pool.
Timed as `timing_s/sleep`; `perf/sleep_bytes` is what was released (summed over devices).
"""

from __future__ import annotations

from typing import Any

import jax
from ml_collections import ConfigDict


def free_cache_engine(cfg: ConfigDict) -> bool:
    """Whether the engine sleeps after `gen`: `rollout.free_cache_engine`, in the synchronous
    rollout mode (a rollout ahead of training keeps generating while the trainer trains)."""
    return bool(cfg.actor_rollout_ref.rollout.free_cache_engine) and (
        cfg.trainer.rollout_mode == "sync"
    )


def _buffers(tree: Any) -> set[int]:
    return {
        s.data.unsafe_buffer_pointer()
        for x in jax.tree.leaves(tree)
        if isinstance(x, jax.Array) and not x.is_deleted()
        for s in x.addressable_shards
    }


def sleep_engine(engine, actor_params: Any) -> int:
    """Puts `engine` to sleep (level 2 when its weights share no buffer with `actor_params`,
    else level 1: the pool only); returns the bytes released. Host sync: none beyond the
    deletions, which wait for the buffers' pending uses."""
    own_weights = not (_buffers(engine.state) & _buffers(actor_params))
    return engine.sleep(2 if own_weights else 1)
