"""GSM8K preprocessing: jsonl → verl-schema parquet → the prompt loader."""

from pathlib import Path

import pyarrow.parquet as pq
import pytest

from hybridjax.data import gsm8k
from hybridjax.data.dataset import DataConfig, train_loader, val_loader
from hybridjax.data.schema import verl_schema
from hybridjax.models.tokenizer import Tokenizer

# A copy of the GSM8K release (MIT licence, see its LICENSE) so the tests run on any clone.
GSM8K = Path(__file__).parents[1] / "assets" / "gsm8k"
ASSET = Path(__file__).parents[2] / "hybridjax" / "assets" / "tokenizers" / "gsm8k_bpe"


@pytest.fixture(scope="module")
def parquet_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("gsm8k")
    gsm8k.main(["--input", str(GSM8K), "--output", str(out)])
    return out


def test_row_counts_and_schema(parquet_dir):
    train, test = (pq.read_table(parquet_dir / f"{s}.parquet") for s in ("train", "test"))
    assert (train.num_rows, test.num_rows) == (7473, 1319)
    assert test.schema == verl_schema(gsm8k.EXTRA_INFO_TYPE)


def test_first_test_row(parquet_dir):
    row = pq.read_table(parquet_dir / "test.parquet").slice(0, 1).to_pylist()[0]
    assert row["data_source"] == "openai/gsm8k" and row["ability"] == "math"
    assert row["reward_model"] == {"style": "rule", "ground_truth": "18"}
    (message,) = row["prompt"]
    assert message["role"] == "user"
    assert message["content"].startswith("Janet’s ducks lay 16 eggs per day.")
    assert message["content"].endswith(' output the final answer after "####".')
    assert row["extra_info"]["split"] == "test" and row["extra_info"]["index"] == 0
    assert row["extra_info"]["answer"].endswith("#### 18")


def test_ground_truth_has_no_thousands_separator(parquet_dir):
    table = pq.read_table(parquet_dir / "train.parquet", columns=["reward_model", "extra_info"])
    rows = table.to_pylist()
    with_comma = [r for r in rows if "," in r["extra_info"]["answer"].split("####")[-1]]
    assert with_comma, "GSM8K train has answers written with thousands separators"
    for r in with_comma:
        truth = r["reward_model"]["ground_truth"]
        assert "," not in truth
        assert truth == r["extra_info"]["answer"].split("#### ")[-1].replace(",", "").strip()
    assert gsm8k.extract_solution("so\n#### 1,234") == "1234"
    with pytest.raises(ValueError, match="no '#### <number>'"):
        gsm8k.extract_solution("no final answer")


def test_loader_round_trip(parquet_dir):
    tok = Tokenizer.from_pretrained(ASSET)
    config = DataConfig(
        train_files=(str(parquet_dir / "train.parquet"),),
        val_files=(str(parquet_dir / "test.parquet"),),
        max_prompt_length=512,
        train_batch_size=256,
        val_batch_size=512,
    )
    val = val_loader(config, tok)
    batch = next(val)
    assert batch["ground_truth"][0] == "18"
    first = batch["input_ids"][0][batch["attention_mask"][0] == 1]
    text = tok.decode(first, skip_special_tokens=False)
    assert text.startswith("<|im_start|>user\nJanet’s ducks")
    assert text.endswith("<|im_end|>\n<|im_start|>assistant\n")
    assert len(val) == 3  # 1319 rows in batches of 512, the last one padded
    train = train_loader(config, tok)
    assert len(train) == 7473 // 256
