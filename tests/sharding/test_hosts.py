"""The pieces that split host-side work over processes, checked in one process: a share of a
batch loads, samples and scores as it does within the whole batch, and the gathered parts equal
the whole. (The multi-process runs themselves are in tests/rl/test_multihost.py.)"""

import dataclasses

import jax
import numpy as np
import pyarrow.parquet as pq
import pytest

from hybridjax.data.dataset import DataConfig, val_loader
from hybridjax.data.schema import table_from_rows
from hybridjax.rewards import RewardConfig, RewardManager, concat_results
from hybridjax.rollout import Engine, RolloutConfig, SamplingParams, generate
from hybridjax.sharding.hosts import DistributedConfig, allgather, local_mesh, share, to_local
from tests.data.test_prompt_dataset import ASSET, EXTRA_INFO_TYPE, _row
from tests.rollout.rollout_testing import make_model, make_prompts

from hybridjax.models.tokenizer import Tokenizer  # isort: skip


def test_one_process_shares_everything():
    assert share(12) == slice(0, 12)
    assert allgather({"a": 1}) == [{"a": 1}]
    mesh = jax.make_mesh((8,), ("data",))
    assert local_mesh(mesh) is mesh
    tree = {"w": jax.numpy.ones(3)}
    assert to_local(tree, mesh) is tree


def test_distributed_config_starts_only_when_asked(monkeypatch):
    for key in ("SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE", "JAX_NUM_PROCESSES"):
        monkeypatch.delenv(key, raising=False)
    assert not DistributedConfig().wanted()
    assert DistributedConfig(num_processes=2).wanted()
    assert DistributedConfig(coordinator_address="host:1234").wanted()
    assert not DistributedConfig(enable="off", num_processes=2).wanted()
    assert DistributedConfig(enable="on").wanted()
    monkeypatch.setenv("SLURM_NTASKS", "4")
    assert DistributedConfig().wanted()


@pytest.mark.parametrize("batch_size", [4, 6])
def test_loader_shares_are_the_rows_of_the_whole_batch(tmp_path, batch_size):
    """Two halves of each validation batch (the last one padded) = the whole batch's rows."""
    path = tmp_path / "ten.parquet"
    rows = [_row("7" * (i + 1), truth=str(i), index=i) for i in range(10)]
    pq.write_table(table_from_rows(rows, EXTRA_INFO_TYPE), path)
    tok = Tokenizer.from_pretrained(ASSET)
    config = DataConfig(val_files=(str(path),), max_prompt_length=32, val_batch_size=batch_size)
    whole = list(val_loader(config, tok).iter_epoch())
    halves = [
        list(
            val_loader(config, tok, lambda n, i=i: slice(i * n // 2, (i + 1) * n // 2)).iter_epoch()
        )
        for i in range(2)
    ]
    assert len(whole) == len(halves[0]) == len(halves[1])
    for full, first, second in zip(whole, *halves, strict=True):
        for key, value in full.items():
            joined = (
                np.concatenate([first[key], second[key]])
                if isinstance(value, np.ndarray)
                else first[key] + second[key]
            )
            np.testing.assert_array_equal(joined, value, err_msg=key)


def test_a_share_samples_as_within_the_batch():
    """Prompts 2..5 generated alone with `first_index=2` draw the same samples as rows 2..5 of
    the whole batch: sampling keys depend on the global prompt index, not the split."""
    engine = Engine(
        make_model(),
        RolloutConfig(page_size=4, max_num_seqs=4, prompt_length=16, response_length=6),
    )
    prompts = make_prompts()
    params = SamplingParams(n=2, temperature=1.0, max_tokens=6, seed=3)
    whole = generate(engine, prompts, params)
    part = generate(engine, prompts[2:], params, first_index=2)
    np.testing.assert_array_equal(part.responses, whole.responses[4:])
    np.testing.assert_allclose(part.rollout_log_probs, whole.rollout_log_probs[4:], atol=1e-6)
    other = generate(engine, prompts[2:], params)  # the same prompts as a batch of their own
    assert not np.array_equal(other.responses, part.responses)


def test_scores_of_shares_concatenate_to_the_whole():
    manager = RewardManager(RewardConfig(num_workers=2))
    responses = ["#### 3", "#### 4", "no answer", "#### 7", "#### 7", "#### 1"]
    truths = ["3", "5", "1", "7", "2", "1"]
    sources = ["openai/gsm8k"] * 6
    lengths = np.array([3, 4, 0, 2, 5, 1])
    whole = manager(responses, sources, truths, None, lengths, 6)
    parts = [
        manager(responses[s], sources[s], truths[s], None, lengths[s], 6)
        for s in (slice(0, 2), slice(2, 6))
    ]
    joined = concat_results(parts)
    np.testing.assert_array_equal(joined.token_level_scores, whole.token_level_scores)
    np.testing.assert_array_equal(joined.scores, whole.scores)
    assert joined.metrics == whole.metrics
    assert dataclasses.asdict(concat_results([whole]))["metrics"] == whole.metrics
    manager.close()
