"""Prompts from verl-schema parquet files, batched through grain with a resumable position.

`PromptDataset` reads one or more parquet files (pyarrow, memory-mapped), renders each row's chat
messages with the tokenizer's chat template (generation prompt added), tokenises, and applies the
length policy to the length measured AFTER templating (REFERENCE.md, "Prompt length"):

  * `filter_overlong_prompts=True`: rows longer than `max_prompt_length` are dropped;
  * otherwise `truncation`: `error` fails at load time naming file and row; `left` keeps the last
    `max_prompt_length` tokens, `right` the first, `middle` the first ⌊P/2⌋ and the last ⌈P/2⌉.

Templating and tokenising happen once, at load time, 1,024 rows at a time (GSM8K's 7,473 train
prompts take a few seconds on 2 CPU cores), so a bad row fails before training starts. Only the
token ids stay in memory (one flat int32 array); the other columns are read from the memory-mapped
file when a batch needs them.

`PromptLoader` turns the dataset into batches with grain (`MapDataset.source → shuffle → batch`):
a fresh shuffle per epoch seeded with `seed + epoch` (grain's own per-epoch reseeding rule),
`drop_last` for training, and for validation a padded last batch with `row_mask` marking real
rows. Its position is two integers (`get_state`/`set_state`, JSON-serialisable), restored exactly:
a resumed loader yields the batches an uninterrupted one would have, never an empty epoch.

Batches are dicts of numpy arrays plus per-row Python lists:
  `input_ids` B×P int32 (left-padded with `pad_token_id`), `attention_mask` B×P int32,
  `position_ids` B×P int32 (0 at the first real token, 0 on padding), `row_mask` (B,) bool,
  `index` (B,) int64 (row number in the dataset), and the lists `data_source`, `ground_truth`
  (`reward_model.ground_truth`), `extra_info`, `raw_prompt` (the chat messages), `ability`.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import grain
import numpy as np
import pyarrow as pa

from hybridjax.data.schema import DataError, check_row, read_table
from hybridjax.models.tokenizer import Tokenizer

TRUNCATION_MODES = ("error", "left", "right", "middle")
NON_TENSOR_KEYS = ("data_source", "ground_truth", "extra_info", "raw_prompt", "ability")
_CHUNK = 1024  # rows rendered and tokenised together at load time


@dataclasses.dataclass(frozen=True)
class DataConfig:
    """The `data.*` keys of verl's trainer config that the input pipeline reads.

    `val_batch_size=-1` means batches of `train_batch_size`; `val_max_samples=-1` every row.
    """

    train_files: tuple[str, ...] = ()
    val_files: tuple[str, ...] = ()
    prompt_key: str = "prompt"
    max_prompt_length: int = 512
    max_response_length: int = 512
    train_batch_size: int = 1024
    val_batch_size: int = -1
    truncation: str = "error"
    filter_overlong_prompts: bool = False
    shuffle: bool = True
    seed: int = 1
    val_max_samples: int = -1

    def __post_init__(self):
        if self.truncation not in TRUNCATION_MODES:
            raise ValueError(
                f"data.truncation={self.truncation!r}; expected one of {TRUNCATION_MODES}"
            )
        for key in ("max_prompt_length", "train_batch_size"):
            if getattr(self, key) < 1:
                raise ValueError(f"data.{key}={getattr(self, key)}; must be >= 1")

    @property
    def resolved_val_batch_size(self) -> int:
        return self.train_batch_size if self.val_batch_size <= 0 else self.val_batch_size

    @classmethod
    def from_config(cls, data: Any) -> DataConfig:
        """From the `data` section of a trainer config (ConfigDict or dict); file lists may be
        one path, a comma-separated string or a sequence. Unknown keys are ignored."""
        values = {}
        for field in dataclasses.fields(cls):
            if field.name in data:
                values[field.name] = data[field.name]
        for key in ("train_files", "val_files"):
            if key in values:
                values[key] = as_file_list(values[key])
        return cls(**values)


def as_file_list(files: str | Sequence[str]) -> tuple[str, ...]:
    """`"a.parquet,b.parquet"` or `["a.parquet", ...]` → a tuple of paths ('' → empty)."""
    if isinstance(files, str):
        return tuple(f.strip() for f in files.split(",") if f.strip())
    return tuple(files)


def truncate(ids: list[int], max_len: int, mode: str) -> list[int]:
    """Cuts a token list to `max_len` by `mode` (`left`, `right`, `middle`); `error` raises.

    Raises:
      ValueError: mode `error` (the caller turns it into a `DataError` naming the row).
    """
    if len(ids) <= max_len:
        return ids
    if mode == "left":
        return ids[-max_len:]
    if mode == "right":
        return ids[:max_len]
    if mode == "middle":
        head = max_len // 2
        return ids[:head] + ids[len(ids) - (max_len - head) :]
    raise ValueError(f"prompt has {len(ids)} tokens > max_prompt_length={max_len}")


class PromptDataset:
    """Tokenised prompts of verl-schema parquet files (a grain random-access data source).

    `dataset[i]` is a dict with `prompt_ids` (int32 array), `index` and the non-tensor fields.
    `num_filtered` counts rows dropped by `filter_overlong_prompts`. `max_samples > 0` keeps only
    the first `max_samples` prompts (`data.val_max_samples`).

    Raises (at construction):
      DataError: a file is missing, unreadable or empty; a column is missing or mistyped; a row
        holds a null; a prompt is too long under `truncation=error`; no row is left after
        filtering.
    """

    def __init__(
        self,
        files: Sequence[str],
        tokenizer: Tokenizer,
        max_prompt_length: int,
        prompt_key: str = "prompt",
        truncation: str = "error",
        filter_overlong_prompts: bool = False,
        max_samples: int = -1,
    ):
        if not files:
            raise ValueError("no parquet files given (data.train_files / data.val_files)")
        self.files = tuple(files)
        self.max_prompt_length = max_prompt_length
        self.prompt_key = prompt_key
        self.num_filtered = 0
        self._tables: list[pa.Table] = []  # memory-mapped; rows are read when a batch needs them
        prompt_ids: list[list[int]] = []
        locations: list[tuple[int, int]] = []  # (file number, row in file) of each kept prompt
        for file_number, path in enumerate(self.files):
            table = read_table(path, prompt_key)
            columns = [prompt_key, "data_source", "reward_model"]
            columns += [c for c in ("extra_info", "ability") if c in table.column_names]
            table = table.select(columns)
            self._tables.append(table)
            rows = self._tokenize(path, table, tokenizer, truncation, filter_overlong_prompts)
            for row, ids in rows:
                if 0 < max_samples <= len(locations):
                    break
                prompt_ids.append(ids)
                locations.append((file_number, row))
        if not locations:
            raise DataError(
                ", ".join(self.files),
                None,
                prompt_key,
                f"no rows left after filtering {self.num_filtered} prompts longer than "
                f"max_prompt_length={max_prompt_length} tokens",
            )
        # Every prompt's ids in one flat int32 array: prompt i is ids[offsets[i]:offsets[i + 1]].
        self._offsets = np.cumsum([0] + [len(ids) for ids in prompt_ids])
        self._ids = np.fromiter((t for ids in prompt_ids for t in ids), np.int32, self._offsets[-1])
        self._locations = np.asarray(locations, np.int64)

    def _tokenize(self, path, table, tokenizer, truncation, filter_overlong):
        """Yields (row, token ids) of the kept rows of one file, templated `_CHUNK` at a time."""
        for start in range(0, table.num_rows, _CHUNK):
            records = table.slice(start, _CHUNK).to_pylist()
            texts = []
            for row, record in enumerate(records, start):
                check_row(path, row, self.prompt_key, record)
                try:
                    texts.append(tokenizer.render_chat(record[self.prompt_key]))
                except Exception as e:
                    raise DataError(path, row, self.prompt_key, f"chat template failed: {e}") from e
            for row, ids in enumerate(tokenizer.encode_batch(texts), start):
                if len(ids) > self.max_prompt_length:
                    if filter_overlong:
                        self.num_filtered += 1
                        continue
                    try:
                        ids = truncate(ids, self.max_prompt_length, truncation)
                    except ValueError as e:
                        raise DataError(
                            path, row, self.prompt_key,
                            f"{e} after the chat template; set data.truncation or "
                            "data.filter_overlong_prompts",
                        ) from e  # fmt: skip
                yield row, ids

    def __len__(self) -> int:
        return len(self._locations)

    def __getitem__(self, index: int) -> dict[str, Any]:
        file_number, row = self._locations[index]
        record = self._tables[file_number].slice(int(row), 1).to_pylist()[0]
        return {
            "prompt_ids": self._ids[self._offsets[index] : self._offsets[index + 1]],
            "index": index,
            "data_source": record["data_source"],
            "ground_truth": record["reward_model"]["ground_truth"],
            "extra_info": record.get("extra_info"),
            "raw_prompt": record[self.prompt_key],
            "ability": record.get("ability"),
        }


def collate(examples: Sequence[dict], max_prompt_length: int, pad_token_id: int) -> dict:
    """Left-pads `prompt_ids` to `max_prompt_length` and stacks a batch (see module docstring)."""
    b = len(examples)
    input_ids = np.full((b, max_prompt_length), pad_token_id, np.int32)
    attention_mask = np.zeros((b, max_prompt_length), np.int32)
    for i, ex in enumerate(examples):
        ids = ex["prompt_ids"]
        input_ids[i, max_prompt_length - len(ids) :] = ids
        attention_mask[i, max_prompt_length - len(ids) :] = 1
    batch = {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "position_ids": np.maximum(np.cumsum(attention_mask, axis=1) - 1, 0).astype(np.int32),
        "row_mask": np.ones(b, bool),
        "index": np.array([ex["index"] for ex in examples], np.int64),
    }
    for key in NON_TENSOR_KEYS:
        batch[key] = [ex[key] for ex in examples]
    return batch


def collate_rows(
    examples: Sequence[dict],
    batch_size: int,
    rows: slice,
    max_prompt_length: int,
    pad_token_id: int,
) -> dict:
    """Collates `rows` of a global batch: a short batch is first padded to `batch_size` rows
    with copies of its first example (`row_mask` False), then only `rows` are stacked (this
    process's share under `jax.distributed`; every row with one process)."""
    real = len(examples)
    padded = list(examples) + [examples[0]] * (batch_size - real)
    batch = collate(padded[rows], max_prompt_length, pad_token_id)
    batch["row_mask"] = (np.arange(batch_size) < real)[rows]
    return batch


class PromptLoader:
    """Endless iterator of batches over a `PromptDataset`, epoch after epoch.

    Attributes:
      epoch, batch_index: where the NEXT batch comes from (the epoch advances as soon as its last
        batch is taken, so a saved state never points at an empty epoch).
      batches_per_epoch: ⌊N/B⌋ with `drop_last`, else ⌈N/B⌉ (the last one padded).
      rows: the rows of each global batch of B this loader collates: `share(B)` when given
        (`sharding.hosts.share`: this process's share), else all of them.

    Raises:
      ValueError: `drop_last` and fewer rows than `batch_size` (every epoch would be empty).
    """

    def __init__(
        self,
        dataset: PromptDataset,
        batch_size: int,
        pad_token_id: int,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = True,
        share: Callable[[int], slice] | None = None,
    ):
        n = len(dataset)
        if drop_last and n < batch_size:
            raise ValueError(
                f"{', '.join(dataset.files)}: {n} rows < batch size {batch_size}; every epoch "
                "would be empty (lower data.train_batch_size)"
            )
        self.dataset, self.batch_size, self.pad_token_id = dataset, batch_size, pad_token_id
        self.shuffle, self.seed, self.drop_last = shuffle, seed, drop_last
        self.rows = share(batch_size) if share is not None else slice(None)
        self.batches_per_epoch = n // batch_size if drop_last else math.ceil(n / batch_size)
        self.epoch, self.batch_index = 0, 0
        self._epoch_batches: tuple[int, grain.MapDataset] | None = None

    def __len__(self) -> int:
        return self.batches_per_epoch

    def _batches(self, epoch: int) -> grain.MapDataset:
        """This epoch's batches as a grain `MapDataset` (random access by batch number)."""
        if self._epoch_batches is None or self._epoch_batches[0] != epoch:
            ds = grain.MapDataset.source(self.dataset)
            if self.shuffle:
                ds = ds.shuffle(seed=(self.seed + epoch) % 2**32)
            ds = ds.batch(self.batch_size, drop_remainder=self.drop_last, batch_fn=list)
            self._epoch_batches = (epoch, ds)
        return self._epoch_batches[1]

    def __iter__(self) -> Iterator[dict]:
        return self

    def __next__(self) -> dict:
        examples = self._batches(self.epoch)[self.batch_index]
        batch = collate_rows(
            examples, self.batch_size, self.rows, self.dataset.max_prompt_length, self.pad_token_id
        )
        self.batch_index += 1
        if self.batch_index == self.batches_per_epoch:
            self.epoch, self.batch_index = self.epoch + 1, 0
        return batch

    def iter_epoch(self) -> Iterator[dict]:
        """The remaining batches of the current epoch (all of them at an epoch's start)."""
        epoch = self.epoch
        while self.epoch == epoch:
            yield next(self)

    def get_state(self) -> dict[str, int]:
        """The position, JSON-serialisable; `set_state` restores it."""
        return {
            "epoch": self.epoch,
            "batch_index": self.batch_index,
            "seed": self.seed,
            "num_rows": len(self.dataset),
            "batch_size": self.batch_size,
        }

    def set_state(self, state: dict[str, int]) -> None:
        """Restores a position saved by `get_state`.

        Raises:
          ValueError: the state was saved with a different dataset size, batch size or seed
            (its batches would not be the ones the saved run would have seen).
        """
        for key, mine in (
            ("seed", self.seed),
            ("num_rows", len(self.dataset)),
            ("batch_size", self.batch_size),
        ):
            if state[key] != mine:
                raise ValueError(f"data iterator state has {key}={state[key]}, this loader {mine}")
        if not 0 <= state["batch_index"] < self.batches_per_epoch:
            raise ValueError(f"data iterator state has batch_index={state['batch_index']}")
        self.epoch, self.batch_index = int(state["epoch"]), int(state["batch_index"])


def train_loader(
    config: DataConfig, tokenizer: Tokenizer, share: Callable[[int], slice] | None = None
) -> PromptLoader:
    """The training loader of verl's `data.*` config: shuffled, `drop_last`."""
    dataset = PromptDataset(
        config.train_files,
        tokenizer,
        config.max_prompt_length,
        config.prompt_key,
        config.truncation,
        config.filter_overlong_prompts,
    )
    return PromptLoader(
        dataset,
        config.train_batch_size,
        tokenizer.pad_token_id,
        shuffle=config.shuffle,
        seed=config.seed,
        drop_last=True,
        share=share,
    )


def val_loader(
    config: DataConfig, tokenizer: Tokenizer, share: Callable[[int], slice] | None = None
) -> PromptLoader:
    """The validation loader: in file order, every row, the last batch padded (`row_mask`)."""
    dataset = PromptDataset(
        config.val_files,
        tokenizer,
        config.max_prompt_length,
        config.prompt_key,
        config.truncation,
        config.filter_overlong_prompts,
        max_samples=config.val_max_samples,
    )
    return PromptLoader(
        dataset,
        config.resolved_val_batch_size,
        tokenizer.pad_token_id,
        shuffle=False,
        drop_last=False,
        share=share,
    )
