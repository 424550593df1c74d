"""Input pipeline: verl-schema parquet → chat template → token ids → grain batches; GSM8K
preprocessing (`python -m hybridjax.data.gsm8k`) and the project's tokenizer
(`python -m hybridjax.data.train_tokenizer`)."""

from hybridjax.data.dataset import (
    DataConfig,
    PromptDataset,
    PromptLoader,
    collate,
    train_loader,
    truncate,
    val_loader,
)
from hybridjax.data.schema import DataError, read_table, table_from_rows, verl_schema

__all__ = [
    "DataConfig",
    "DataError",
    "PromptDataset",
    "PromptLoader",
    "collate",
    "read_table",
    "table_from_rows",
    "train_loader",
    "truncate",
    "val_loader",
    "verl_schema",
]
