"""Data-parallel replicas: placement by expected tokens, one replica per prompt group, and a
pool per replica (a device holds only its replica's pages) on data 4 × tensor 2."""

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec
from rollout_testing import make_prompts

from hybridjax.rollout import Engine, RolloutConfig, SamplingParams
from hybridjax.rollout.paged_cache import PagedKVCache
from hybridjax.rollout.pages import Request
from hybridjax.rollout.replicas import ReplicaBooks, expected_tokens
from hybridjax.sharding import MeshConfig, make_meshes

SMALL = RolloutConfig(page_size=4, num_pages=12, max_num_seqs=2, prompt_length=8, response_length=8)


def _request(length: int, n: int, max_tokens: int, index: int = 0) -> Request:
    return Request(tuple(range(1, length + 1)), SamplingParams(n=n, max_tokens=max_tokens), index)


def test_expected_tokens_by_hand():
    assert expected_tokens(_request(5, 3, 7)) == 3 * (5 + 7)


def test_place_takes_the_least_loaded_replica_with_room():
    books = ReplicaBooks(SMALL, replicas=3, pages=12)
    big, small = _request(8, 2, 8), _request(2, 1, 2)  # 32 and 4 expected tokens
    assert books.place(big, [2, 2, 2]) == 0  # ties: lowest index
    books.admit(big, 0)
    assert books.load == [32, 0, 0] and books.promised == [2, 0, 0]
    assert books.place(small, [2, 2, 2]) == 1
    books.admit(small, 1)
    assert books.place(small, [2, 2, 2]) == 2
    books.admit(small, 2)
    # Replica 0 is the most loaded; 1 and 2 have 4 tokens each, replica 2 has no free slot.
    assert books.place(small, [2, 2, 1]) == 1
    # A group needing more pages than a replica has free is placed elsewhere, or nowhere.
    group = books.books[0].group_pages(8, big.params)  # 2 + 2 × 3 - 1 = 7 of 12 pages
    assert group == 7
    assert books.place(big, [2, 0, 0]) is None  # replica 0: 5 pages left, needs 7
    assert books.place(big, [2, 2, 2]) == 1


@pytest.fixture(scope="module")
def replicated(eos_model):
    mesh = make_meshes(MeshConfig(generate=(4, 2))).generate
    config = RolloutConfig(
        page_size=4, num_pages=24, max_num_seqs=2, prompt_length=16, response_length=8,
        decode_steps_per_call=4,
    )  # fmt: skip
    return Engine(eos_model, config, mesh=mesh)


def test_a_device_holds_only_its_replicas_pages(replicated):
    engine = replicated
    assert engine.replicas == 4 and engine.num_pages == 24
    pool = engine.k_pools[0]
    kv, d = engine.model_config.num_key_value_heads, engine.model_config.resolved_head_dim
    assert pool.shape == (kv, 4 * 24, 4, d)
    assert pool.sharding.spec == PartitionSpec("tensor", "data")
    assert {s.data.shape for s in pool.addressable_shards} == {(kv // 2, 24, 4, d)}
    assert len(engine.slots.active) == 4 * 2  # max_num_seqs slots per replica


def test_groups_stay_on_one_replica_balanced_by_expected_tokens(replicated):
    engine = replicated
    prompts = make_prompts((9, 3, 5, 12, 2), seed=3)
    sp = SamplingParams(n=2, temperature=0.0, max_tokens=8)
    prefixes = [engine.admit(Request(tuple(p), sp, i)) for i, p in enumerate(prompts[:4])]
    # 4 replicas of 2 slots: the first four groups take one replica each; the fifth waits
    # (every slot is promised).
    assert [p.replica for p in prefixes] == [0, 1, 2, 3]
    assert not engine.can_prefill(Request(tuple(prompts[4]), sp, 4))
    with pytest.raises(RuntimeError, match="no replica"):
        engine.admit(Request(tuple(prompts[4]), sp, 4))
    engine.run_prefill(prefixes)
    with pytest.raises(ValueError, match="replica"):
        engine.insert(prefixes[1], 0)
    for prefix in prefixes:
        for slot in engine.free_slots_of(prefix.replica):
            engine.insert(prefix, slot)
    assert engine.num_active == 8
    while engine.num_active:
        engine.generate(4)
    for slot in range(8):
        engine.free_resource(slot)
    assert engine.num_free_pages == 4 * 24 and engine.pages.load == [0, 0, 0, 0]
    assert np.all(engine.slots.active == 0)


def test_pages_from_memory_by_hand():
    pages = PagedKVCache.pages_from_memory
    two = [dict(bytes_limit=1000, bytes_in_use=200), dict(bytes_limit=1000, bytes_in_use=400)]
    assert pages(two, 0.5, 100) == 3  # the tightest device: 0.5 × 600 // 100
    assert pages(two[:1], 0.9, 100) == 7  # 0.9 × 800 = 720
    assert pages([dict(bytes_limit=100, bytes_in_use=100)], 0.5, 100) == 1  # at least one
    assert pages([two[0], None], 0.5, 100) is None  # a device without statistics: CPU default
    assert pages([{}], 0.5, 100) is None


def test_pool_is_sized_from_the_free_memory_of_the_mesh_devices(eos_model, monkeypatch):
    # free bytes per device id: devices 0-3 (not in the mesh) hold less than devices 4-7
    free = {i: (1 << 20) * (1 if i < 4 else 10 + i) for i in range(8)}
    device_type = type(jax.devices()[0])
    monkeypatch.setattr(
        device_type, "memory_stats", lambda d: dict(bytes_limit=free[d.id] + 64, bytes_in_use=64)
    )
    mesh = make_meshes(MeshConfig(generate=(2, 2)), jax.devices()[4:]).generate
    config = RolloutConfig(
        page_size=4, max_num_seqs=2, prompt_length=16, response_length=8,
        gpu_memory_utilization=0.5,
    )  # fmt: skip
    engine = Engine(eos_model, config, mesh=mesh)
    page = PagedKVCache.page_bytes(eos_model.config, 4, engine.kv_dtype, 2)
    assert engine.num_pages == int(0.5 * free[4]) // page  # device 4: the tightest of 4-7
    assert engine.k_pools[0].shape[1] == 2 * engine.num_pages  # one pool per replica
