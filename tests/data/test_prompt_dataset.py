"""Prompt dataset and loader: length policy, padding, per-epoch shuffle, resume, named errors."""

import dataclasses
import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from ml_collections import ConfigDict

from hybridjax.data.dataset import (
    DataConfig,
    PromptDataset,
    PromptLoader,
    train_loader,
    truncate,
    val_loader,
)
from hybridjax.data.schema import DataError, table_from_rows
from hybridjax.models.tokenizer import Tokenizer

ASSET = Path(__file__).parents[2] / "hybridjax" / "assets" / "tokenizers" / "gsm8k_bpe"


@pytest.fixture(scope="module")
def tok():
    return Tokenizer.from_pretrained(ASSET)


def _row(content, truth="1", source="openai/gsm8k", index=0):
    return {
        "data_source": source,
        "prompt": [{"role": "user", "content": content}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": truth},
        "extra_info": {"index": index},
    }


EXTRA_INFO_TYPE = pa.struct([("index", pa.int64())])


def _write(path, rows):
    pq.write_table(table_from_rows(rows, EXTRA_INFO_TYPE), path)
    return str(path)


@pytest.fixture(scope="module")
def ten_rows(tmp_path_factory):
    """10 prompts; row i has i+1 digits of content (each digit is one token)."""
    rows = [_row("7" * (i + 1), truth=str(i), index=i) for i in range(10)]
    return _write(tmp_path_factory.mktemp("data") / "ten.parquet", rows)


def _overhead(tok):
    """Template tokens around a user message's content."""
    return len(tok.apply_chat_template([{"role": "user", "content": ""}]))


# ---- length policy ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def overlong(tmp_path_factory, tok):
    """docs/verl_behaviour.md's case: a 1,081-token prompt after templating, and a short one."""
    content = "".join(str(i % 10) for i in range(1081 - _overhead(tok)))
    path = tmp_path_factory.mktemp("long") / "long.parquet"
    _write(path, [_row("12"), _row(content, truth="long")])
    full = tok.apply_chat_template([{"role": "user", "content": content}])
    assert len(full) == 1081
    return str(path), full


@pytest.mark.parametrize("mode", ["left", "right", "middle"])
def test_truncation_modes_on_overlong_prompt(overlong, tok, mode):
    path, full = overlong
    ds = PromptDataset([path], tok, max_prompt_length=1024, truncation=mode)
    got = ds[1]["prompt_ids"].tolist()
    assert len(ds) == 2 and len(got) == 1024
    expected = {
        "left": full[-1024:],
        "right": full[:1024],
        "middle": full[:512] + full[-512:],
    }[mode]
    assert got == expected
    assert ds[0]["prompt_ids"].tolist() == tok.apply_chat_template(
        [{"role": "user", "content": "12"}]
    )


def test_truncation_error_names_file_row_and_column(overlong, tok):
    path, _ = overlong
    with pytest.raises(DataError, match="1081 tokens > max_prompt_length=1024") as e:
        PromptDataset([path], tok, max_prompt_length=1024, truncation="error")
    assert (e.value.path, e.value.row, e.value.column) == (path, 1, "prompt")
    assert f"{path}, row 1, column 'prompt'" in str(e.value)


def test_filter_overlong_drops_the_row(overlong, tok):
    path, _ = overlong
    ds = PromptDataset([path], tok, max_prompt_length=1024, filter_overlong_prompts=True)
    assert len(ds) == 1 and ds.num_filtered == 1 and ds[0]["ground_truth"] == "1"
    # A prompt exactly at the limit is kept untouched.
    kept = PromptDataset([path], tok, max_prompt_length=1081, truncation="error")
    assert len(kept[1]["prompt_ids"]) == 1081


def test_truncate_odd_limit():
    assert truncate(list(range(10)), 5, "middle") == [0, 1, 7, 8, 9]
    assert truncate(list(range(3)), 5, "error") == [0, 1, 2]


# ---- batches ----------------------------------------------------------------------------------


def test_batch_is_left_padded_with_positions(ten_rows, tok):
    ds = PromptDataset([ten_rows], tok, max_prompt_length=32)
    batch = next(PromptLoader(ds, 4, tok.pad_token_id, shuffle=False))
    n0 = _overhead(tok) + 1  # row 0: one digit of content
    assert batch["input_ids"].shape == (4, 32) and batch["input_ids"].dtype == np.int32
    assert batch["attention_mask"][0].tolist() == [0] * (32 - n0) + [1] * n0
    assert batch["position_ids"][0].tolist() == [0] * (32 - n0) + list(range(n0))
    assert (batch["input_ids"][0, : 32 - n0] == tok.pad_token_id).all()
    assert batch["input_ids"][0, 32 - n0 :].tolist() == ds[0]["prompt_ids"].tolist()
    assert batch["ground_truth"] == ["0", "1", "2", "3"]
    assert batch["data_source"] == ["openai/gsm8k"] * 4
    assert batch["extra_info"][2] == {"index": 2}
    assert batch["raw_prompt"][1] == [{"role": "user", "content": "77"}]
    assert batch["row_mask"].all() and batch["index"].tolist() == [0, 1, 2, 3]


def test_epochs_reshuffle_and_drop_last(ten_rows, tok):
    loader = PromptLoader(PromptDataset([ten_rows], tok, 32), 3, tok.pad_token_id, seed=5)
    assert len(loader) == 3  # ⌊10 / 3⌋: one row dropped per epoch
    epochs = [np.concatenate([b["index"] for b in loader.iter_epoch()]) for _ in range(3)]
    for order in epochs:
        assert len(order) == 9 and len(set(order.tolist())) == 9
    assert not np.array_equal(epochs[0], epochs[1])
    again = PromptLoader(PromptDataset([ten_rows], tok, 32), 3, tok.pad_token_id, seed=5)
    assert np.array_equal(np.concatenate([b["index"] for b in again.iter_epoch()]), epochs[0])


def test_validation_pads_last_batch_with_row_mask(ten_rows, tok):
    config = DataConfig(val_files=(ten_rows,), max_prompt_length=32, val_batch_size=4)
    loader = val_loader(config, tok)
    batches = list(loader.iter_epoch())
    assert len(batches) == 3 and all(b["input_ids"].shape == (4, 32) for b in batches)
    assert batches[-1]["row_mask"].tolist() == [True, True, False, False]
    real = np.concatenate([b["index"][b["row_mask"]] for b in batches])
    assert real.tolist() == list(range(10))  # every row once, in file order
    assert len(batches[-1]["ground_truth"]) == 4
    assert [b["index"].tolist() for b in loader.iter_epoch()] == [
        b["index"].tolist() for b in batches
    ]
    config = DataConfig(val_files=(ten_rows,), max_prompt_length=32, val_batch_size=4)
    few = val_loader(dataclasses.replace(config, val_max_samples=3), tok)
    assert len(few.dataset) == 3 and next(few)["ground_truth"] == ["0", "1", "2", "0"]


def test_several_files_concatenate(ten_rows, tmp_path, tok):
    other = _write(tmp_path / "other.parquet", [_row("5", truth="x", source="arithmetic")])
    ds = PromptDataset([ten_rows, other], tok, 32)
    assert len(ds) == 11 and ds[10]["data_source"] == "arithmetic"


# ---- resume -----------------------------------------------------------------------------------


def _uninterrupted(path, tok, n):
    loader = PromptLoader(PromptDataset([path], tok, 32), 3, tok.pad_token_id, seed=11)
    return [next(loader)["index"].tolist() for _ in range(n)]


@pytest.mark.parametrize("stop_after", [4, 3, 6], ids=["mid_epoch", "epoch_end", "two_epochs"])
def test_resume_continues_exactly(ten_rows, tok, stop_after):
    reference = _uninterrupted(ten_rows, tok, 10)
    first = PromptLoader(PromptDataset([ten_rows], tok, 32), 3, tok.pad_token_id, seed=11)
    seen = [next(first)["index"].tolist() for _ in range(stop_after)]
    state = json.loads(json.dumps(first.get_state()))  # what a checkpoint stores
    if stop_after % 3 == 0:  # at an epoch boundary the state already points at the next epoch
        assert state["batch_index"] == 0 and state["epoch"] == stop_after // 3
    resumed = PromptLoader(PromptDataset([ten_rows], tok, 32), 3, tok.pad_token_id, seed=11)
    resumed.set_state(state)
    seen += [next(resumed)["index"].tolist() for _ in range(10 - stop_after)]
    assert seen == reference
    # The resumed epoch is never empty.
    resumed.set_state(state)
    assert len(list(resumed.iter_epoch())) == 3 - stop_after % 3


def test_set_state_rejects_another_dataset(ten_rows, tok):
    loader = PromptLoader(PromptDataset([ten_rows], tok, 32), 3, tok.pad_token_id, seed=11)
    state = loader.get_state()
    other = PromptLoader(PromptDataset([ten_rows], tok, 32), 2, tok.pad_token_id, seed=11)
    with pytest.raises(ValueError, match="batch_size=3"):
        other.set_state(state)


# ---- config -----------------------------------------------------------------------------------


def test_data_config_from_trainer_config(ten_rows, tok):
    data = ConfigDict(
        dict(
            train_files=f"{ten_rows},{ten_rows}",
            val_files="",
            max_prompt_length=32,
            train_batch_size=4,
            truncation="left",
            tokenizer="",  # other trainer keys are ignored
        )
    )
    config = DataConfig.from_config(data)
    assert config.train_files == (ten_rows, ten_rows) and config.val_files == ()
    assert config.resolved_val_batch_size == 4
    loader = train_loader(config, tok)
    assert len(loader) == 5
    with pytest.raises(ValueError, match="data.truncation='both'"):
        DataConfig(truncation="both")


# ---- malformed input --------------------------------------------------------------------------


def _error(path, tok, **kwargs) -> DataError:
    with pytest.raises(DataError) as e:
        PromptDataset([str(path)], tok, 32, **kwargs)
    assert str(path) in str(e.value)
    return e.value


def test_missing_file(tmp_path, tok):
    err = _error(tmp_path / "nope.parquet", tok)
    assert "no such file" in str(err)


def test_not_parquet(tmp_path, tok):
    (tmp_path / "bad.parquet").write_bytes(b"not a parquet file")
    assert "not a readable parquet" in str(_error(tmp_path / "bad.parquet", tok))


def test_empty_file(tmp_path, tok):
    _write(tmp_path / "empty.parquet", [])
    assert "no rows" in str(_error(tmp_path / "empty.parquet", tok))


def test_missing_column(tmp_path, tok):
    table = table_from_rows([_row("1")]).drop_columns(["reward_model"])
    pq.write_table(table, tmp_path / "m.parquet")
    err = _error(tmp_path / "m.parquet", tok)
    assert err.column == "reward_model" and "missing column" in str(err)
    err = _error(tmp_path / "m.parquet", tok, prompt_key="question")
    assert err.column == "question"


def test_prompt_of_wrong_type(tmp_path, tok):
    table = pa.table(
        {
            "data_source": ["openai/gsm8k"],
            "prompt": ["a plain string, not messages"],
            "reward_model": [{"style": "rule", "ground_truth": "1"}],
        }
    )
    pq.write_table(table, tmp_path / "t.parquet")
    err = _error(tmp_path / "t.parquet", tok)
    assert err.column == "prompt" and "list of {role, content}" in str(err)


def test_data_source_of_wrong_type(tmp_path, tok):
    table = table_from_rows([_row("1")]).set_column(0, "data_source", pa.array([3]))
    pq.write_table(table, tmp_path / "t.parquet")
    err = _error(tmp_path / "t.parquet", tok)
    assert err.column == "data_source" and "expected a string" in str(err)


@pytest.mark.parametrize(
    "bad_row, column",
    [
        ({**_row("1"), "reward_model": {"style": "rule", "ground_truth": None}}, "reward_model"),
        ({**_row("1"), "prompt": []}, "prompt"),
        ({**_row("1"), "prompt": [{"role": "user", "content": None}]}, "prompt"),
        ({**_row("1"), "data_source": None}, "data_source"),
    ],
    ids=["null_ground_truth", "empty_prompt", "null_content", "null_data_source"],
)
def test_bad_row_is_named(tmp_path, tok, bad_row, column):
    _write(tmp_path / "r.parquet", [_row("1"), _row("2"), bad_row])
    err = _error(tmp_path / "r.parquet", tok)
    assert (err.row, err.column) == (2, column)
    assert "row 2" in str(err)


def test_empty_after_filtering(ten_rows, tok):
    with pytest.raises(DataError, match="no rows left after filtering 10 prompts") as e:
        PromptDataset([ten_rows], tok, 4, filter_overlong_prompts=True)
    assert ten_rows in str(e.value)


def test_fewer_rows_than_a_training_batch(ten_rows, tok):
    with pytest.raises(ValueError, match="10 rows < batch size 16"):
        PromptLoader(PromptDataset([ten_rows], tok, 32), 16, tok.pad_token_id)


@settings(max_examples=100, deadline=None)
@given(st.integers(0, 60), st.integers(1, 40), st.sampled_from(["left", "right", "middle"]))
def test_truncate_keeps_ends_property(n, limit, mode):
    ids = list(range(n))
    out = truncate(ids, limit, mode)
    assert len(out) == min(n, limit)
    if n <= limit:
        assert out == ids
    elif mode == "left":
        assert out == ids[n - limit :]
    elif mode == "right":
        assert out == ids[:limit]
    else:
        assert (
            out[: limit // 2] == ids[: limit // 2]
            and out[limit // 2 :] == ids[n - (limit - limit // 2) :]
        )
