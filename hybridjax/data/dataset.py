"""Prompts from verl-schema parquet files, batched through grain with a resumable position.

`PromptDataset` reads one or more parquet files (pyarrow, memory-mapped), renders each row's chat
messages with the tokenizer's chat template (generation prompt added), tokenises, and applies the
length policy to the length measured AFTER templating (docs/verl_behaviour.md, "Prompt length"):

  * `filter_overlong_prompts=True`: rows longer than `max_prompt_length` are dropped;
  * otherwise `truncation`: `error` fails at load time naming file and row; `left` keeps the last
    `max_prompt_length` tokens, `right` the first, `middle` the first ⌊P/2⌋ and the last ⌈P/2⌉.
    How many rows were dropped or cut is logged at load (`num_filtered`, `num_truncated`, and a
    warning when `right` cut the end of the template: the assistant header the model answers
    after) and reported by the trainer as `data/*` metrics.

Message text that spells a special token (`<|im_end|><|im_start|>system`) becomes that control
token when the rendered template is tokenised, as in `transformers`. Such rows are counted and
warned about at load (`num_special_token_rows`); `special_tokens_in_content` picks what happens:
`keep` (the default, as `transformers`), `escape` (message contents are tokenised as plain text,
the template's own special tokens stay special) or `error` (names file, row and token).

Templating and tokenising happen once, at load time, 1,024 rows at a time (GSM8K's 7,473 train
prompts take a few seconds on 2 CPU cores), so a bad row fails before training starts. Only the
token ids stay in memory (one flat int32 array); the other columns are read from the memory-mapped
file when a batch needs them.

`PromptLoader` turns the dataset into batches with grain (`MapDataset.source → batch`): a fresh
shuffle per epoch seeded with `seed + epoch` (grain's own per-epoch reseeding rule), drawn whole
with numpy (O(N) memory, microseconds per epoch; grain's `shuffle` computes each index on demand
at about 17/N ms a lookup, 2 ms a row for an 8-row dataset, i.e. 18 ms a step on the quick-start
workload),
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
import logging
import math
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import grain
import numpy as np
import pyarrow as pa

from hybridjax.data.schema import DataError, check_row, read_table
from hybridjax.errors import ConfigError, InputFileError
from hybridjax.models.tokenizer import Tokenizer

TRUNCATION_MODES = ("error", "left", "right", "middle")
SPECIAL_TOKENS_IN_CONTENT = ("keep", "escape", "error")  # data.special_tokens_in_content
NON_TENSOR_KEYS = ("data_source", "ground_truth", "extra_info", "raw_prompt", "ability")
_CHUNK = 1024  # rows rendered and tokenised together at load time
log = logging.getLogger(__name__)


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
    special_tokens_in_content: str = "keep"
    # any `reward_model.ground_truth` type (a custom reward function reads it), else a string
    # or a number, the types the built-in reward functions compare against
    any_ground_truth: bool = False

    def __post_init__(self):
        if self.truncation not in TRUNCATION_MODES:
            raise ValueError(
                f"data.truncation={self.truncation!r}; expected one of {TRUNCATION_MODES}"
            )
        if self.special_tokens_in_content not in SPECIAL_TOKENS_IN_CONTENT:
            raise ValueError(
                f"data.special_tokens_in_content={self.special_tokens_in_content!r}; expected "
                f"one of {SPECIAL_TOKENS_IN_CONTENT}"
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
    `num_filtered` counts rows dropped by `filter_overlong_prompts`, `num_truncated` rows cut by
    `truncation`, `num_special_token_rows` rows whose message text spells a special token.
    `max_samples > 0` keeps only the first `max_samples` prompts (`data.val_max_samples`).

    Raises (at construction):
      DataError: a file is missing, unreadable or empty; a column is missing or mistyped (the
        ground truth must be a string or number unless `any_ground_truth`); a row holds a null
        or invalid UTF-8; a prompt is too long under `truncation=error`; message text spells a
        special token under `special_tokens_in_content=error`; no row is left after filtering.
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
        special_tokens_in_content: str = "keep",
        any_ground_truth: bool = False,
    ):
        if not files:
            raise ValueError("no parquet files given (data.train_files / data.val_files)")
        self.files = tuple(files)
        self.max_prompt_length = max_prompt_length
        self.prompt_key = prompt_key
        self.special_tokens_in_content = special_tokens_in_content
        self.num_filtered = self.num_truncated = self.num_special_token_rows = 0
        self._right_cut = 0
        added = tokenizer.backend.get_added_tokens_decoder().values()
        self._specials = tuple(t.content for t in added if t.special)
        self._tables: list[pa.Table] = []  # memory-mapped; rows are read when a batch needs them
        prompt_ids: list[list[int]] = []
        locations: list[tuple[int, int]] = []  # (file number, row in file) of each kept prompt
        for file_number, path in enumerate(self.files):
            table = read_table(path, prompt_key, any_ground_truth)
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
        self._log_counts(truncation)
        # Every prompt's ids in one flat int32 array: prompt i is ids[offsets[i]:offsets[i + 1]].
        self._offsets = np.cumsum([0] + [len(ids) for ids in prompt_ids])
        self._ids = np.fromiter((t for ids in prompt_ids for t in ids), np.int32, self._offsets[-1])
        self._locations = np.asarray(locations, np.int64)

    def _tokenize(self, path, table, tokenizer, truncation, filter_overlong):
        """Yields (row, token ids) of the kept rows of one file, templated `_CHUNK` at a time."""
        for start in range(0, table.num_rows, _CHUNK):
            records = table.slice(start, _CHUNK).to_pylist()
            texts, escaped = [], {}
            for row, record in enumerate(records, start):
                check_row(path, row, self.prompt_key, record)
                messages = record[self.prompt_key]
                try:
                    texts.append(tokenizer.render_chat(messages))
                    if self._spells_special_token(path, row, messages):
                        escaped[row] = encode_escaped(tokenizer, messages)
                except DataError:
                    raise
                except Exception as e:
                    raise DataError(path, row, self.prompt_key, f"chat template failed: {e}") from e
            for row, ids in enumerate(tokenizer.encode_batch(texts), start):
                ids = escaped.get(row, ids)
                if len(ids) > self.max_prompt_length:
                    if filter_overlong:
                        self.num_filtered += 1
                        continue
                    self.num_truncated += 1
                    self._right_cut += truncation == "right"
                    try:
                        ids = truncate(ids, self.max_prompt_length, truncation)
                    except ValueError as e:
                        raise DataError(
                            path, row, self.prompt_key,
                            f"{e} after the chat template; set data.truncation or "
                            "data.filter_overlong_prompts",
                        ) from e  # fmt: skip
                yield row, ids

    def _spells_special_token(self, path: str, row: int, messages: list[dict]) -> bool:
        """Counts a row whose message text contains a special token's string; True when it is
        to be escaped, DataError under `error`."""
        for i, message in enumerate(messages):
            found = [t for t in self._specials if t in message["content"]]
            if not found:
                continue
            self.num_special_token_rows += 1
            if self.special_tokens_in_content == "error":
                raise DataError(
                    path, row, self.prompt_key,
                    f"message {i} contains the special token text {found[0]!r}; remove it or set "
                    f"data.special_tokens_in_content to one of {SPECIAL_TOKENS_IN_CONTENT}",
                )  # fmt: skip
            return self.special_tokens_in_content == "escape"
        return False

    def _log_counts(self, truncation: str) -> None:
        files = ", ".join(self.files)
        if self.num_filtered:
            log.warning(
                "%s: dropped %d prompts longer than max_prompt_length=%d tokens "
                "(data.filter_overlong_prompts)", files, self.num_filtered, self.max_prompt_length
            )  # fmt: skip
        if self.num_truncated:
            log.warning(
                "%s: cut %d prompts to max_prompt_length=%d tokens (data.truncation=%s)",
                files, self.num_truncated, self.max_prompt_length, truncation,
            )  # fmt: skip
        if self._right_cut:
            log.warning(
                "%s: data.truncation=right cut the end of %d prompts, including the assistant "
                "header the model answers after; left or middle keep it", files, self._right_cut
            )  # fmt: skip
        if self.num_special_token_rows:
            log.warning(
                "%s: %d rows have message text that spells a special token (e.g. %s); "
                "data.special_tokens_in_content=%s%s",
                files, self.num_special_token_rows, self._specials[-1],
                self.special_tokens_in_content,
                " (they become control tokens, as in transformers; 'escape' keeps them text)"
                if self.special_tokens_in_content == "keep" else "",
            )  # fmt: skip

    def counts(self) -> dict[str, int]:
        """What loading dropped, cut or flagged (see the class docstring)."""
        return {
            "filtered_prompts": self.num_filtered,
            "truncated_prompts": self.num_truncated,
            "special_token_rows": self.num_special_token_rows,
        }

    def data_sources(self) -> set[str]:
        """The distinct `data_source` values of the files (every row, kept or filtered)."""
        return {str(v) for t in self._tables for v in t["data_source"].unique().to_pylist()}

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


def encode_escaped(tokenizer: Tokenizer, messages: list[dict]) -> list[int]:
    """Token ids of the templated `messages` with each message's content tokenised as plain
    text (a special token's string stays text); the template's own tokens are as usual.

    Raises:
      ValueError: the template does not place each content exactly once, verbatim.
    """
    marks = [f"\x00{i}\x00" for i in range(len(messages))]
    rendered = tokenizer.render_chat(
        [dict(m, content=mark) for m, mark in zip(messages, marks, strict=True)]
    )
    ids, rest = [], rendered
    backend = tokenizer.backend
    for message, mark in zip(messages, marks, strict=True):
        if rest.count(mark) != 1:
            raise ValueError("the chat template changes message contents; cannot escape them")
        head, _, rest = rest.partition(mark)
        ids += tokenizer.encode(head)
        backend.encode_special_tokens = True  # split special-token strings as plain text
        try:
            ids += tokenizer.encode(message["content"])
        finally:
            backend.encode_special_tokens = False
    return ids + tokenizer.encode(rest)


def collate(examples: Sequence[dict], max_prompt_length: int, pad_token_id: int) -> dict:
    """Left-pads `prompt_ids` to `max_prompt_length` and stacks a batch (see module docstring)."""
    b = len(examples)
    input_ids = np.full((b, max_prompt_length), pad_token_id, np.int32)
    attention_mask = np.zeros((b, max_prompt_length), np.int32)
    for i, ex in enumerate(examples):
        ids = ex["prompt_ids"]
        input_ids[i, max_prompt_length - len(ids) :] = ids
        attention_mask[i, max_prompt_length - len(ids) :] = 1
    batch: dict[str, Any] = {
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
            raise InputFileError(
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
            if self.shuffle:  # the epoch's whole order at once, as verl's RandomSampler
                order = np.random.default_rng((self.seed + epoch) % 2**32).permutation(len(ds))
                ds = grain.MapDataset.source(order).map(lambda i: self.dataset[int(i)])
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


def _dataset(config: DataConfig, tokenizer: Tokenizer, files, max_samples: int = -1):
    """The `PromptDataset` of `files` with the `data.*` settings both loaders share."""
    return PromptDataset(
        files,
        tokenizer,
        config.max_prompt_length,
        config.prompt_key,
        config.truncation,
        config.filter_overlong_prompts,
        max_samples=max_samples,
        special_tokens_in_content=config.special_tokens_in_content,
        any_ground_truth=config.any_ground_truth,
    )


def _pad_id(tokenizer: Tokenizer) -> int:
    """The id prompts are left-padded with. Raises ConfigError for a tokenizer with neither a
    pad nor an EOS token."""
    if tokenizer.pad_token_id is None:
        raise ConfigError("the tokenizer has neither a pad_token nor an eos_token to pad prompts")
    return tokenizer.pad_token_id


def train_loader(
    config: DataConfig, tokenizer: Tokenizer, share: Callable[[int], slice] | None = None
) -> PromptLoader:
    """The training loader of verl's `data.*` config: shuffled, `drop_last`."""
    pad = _pad_id(tokenizer)
    return PromptLoader(
        _dataset(config, tokenizer, config.train_files),
        config.train_batch_size,
        pad,
        shuffle=config.shuffle,
        seed=config.seed,
        drop_last=True,
        share=share,
    )


def val_loader(
    config: DataConfig, tokenizer: Tokenizer, share: Callable[[int], slice] | None = None
) -> PromptLoader:
    """The validation loader: in file order, every row, the last batch padded (`row_mask`)."""
    pad = _pad_id(tokenizer)
    return PromptLoader(
        _dataset(config, tokenizer, config.val_files, config.val_max_samples),
        config.resolved_val_batch_size,
        pad,
        shuffle=False,
        drop_last=False,
        share=share,
    )
