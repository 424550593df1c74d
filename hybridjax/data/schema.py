"""verl's parquet schema: building tables, and checking what a user's file holds.

One row per prompt (verl's schema):

| column         | arrow type                                       |
|----------------|--------------------------------------------------|
| `data_source`  | string (selects the reward function)             |
| `prompt`       | list<struct<role: string, content: string>>      |
| `ability`      | string (optional)                                |
| `reward_model` | struct<style: string, ground_truth: string>      |
| `extra_info`   | struct (optional; passed to the reward function) |

Every error names the file, the row (or "every row" for a column-type problem) and the column.
"""

from __future__ import annotations

import os

import pyarrow as pa
import pyarrow.parquet as pq

from hybridjax.errors import InputFileError

MESSAGE_TYPE = pa.struct([("role", pa.string()), ("content", pa.string())])
PROMPT_TYPE = pa.list_(MESSAGE_TYPE)
REWARD_MODEL_TYPE = pa.struct([("style", pa.string()), ("ground_truth", pa.string())])
REQUIRED_COLUMNS = ("data_source", "reward_model")


class DataError(InputFileError):
    """A problem with an input file, located by file, row and column."""

    def __init__(self, path: str, row: int | None, column: str | None, problem: str):
        self.path, self.row, self.column = path, row, column
        where = [os.fspath(path)]
        if row is not None:
            where.append(f"row {row}")
        if column is not None:
            where.append(f"column {column!r}")
        super().__init__(f"{', '.join(where)}: {problem}")


def verl_schema(extra_info_type: pa.DataType | None = None) -> pa.Schema:
    """The arrow schema of a verl parquet file (with `extra_info` when its type is given)."""
    fields = [
        ("data_source", pa.string()),
        ("prompt", PROMPT_TYPE),
        ("ability", pa.string()),
        ("reward_model", REWARD_MODEL_TYPE),
    ]
    if extra_info_type is not None:
        fields.append(("extra_info", extra_info_type))
    return pa.schema(fields)


def table_from_rows(rows: list[dict], extra_info_type: pa.DataType | None = None) -> pa.Table:
    """An arrow table in verl's schema from python rows (dicts with the columns above)."""
    return pa.Table.from_pylist(rows, schema=verl_schema(extra_info_type))


def read_table(path: str, prompt_key: str = "prompt", any_ground_truth: bool = True) -> pa.Table:
    """Reads one parquet file (memory-mapped) and checks its columns, their types and that
    every string is valid UTF-8.

    Args:
      any_ground_truth: accept any type of `reward_model.ground_truth`; False: only a string
        or a number (what the built-in reward functions compare against).
    Raises:
      DataError: the file is missing, a directory, unreadable or empty; a required column is
        missing; a column has the wrong type (e.g. `prompt` is a string instead of a list of
        messages); a string is not valid UTF-8 (names the row).
    """
    if os.path.isdir(path):
        inside = sorted(n for n in os.listdir(path) if n.endswith(".parquet"))[:3]
        hint = f" (it holds {', '.join(inside)})" if inside else ""
        raise DataError(path, None, None, f"is a directory, not a parquet file{hint}")
    if not os.path.isfile(path):
        raise DataError(path, None, None, "no such file")
    try:
        table = pq.read_table(path, memory_map=True)
    except (pa.ArrowInvalid, OSError) as e:
        raise DataError(path, None, None, f"not a readable parquet file ({e})") from e
    if table.num_rows == 0:
        raise DataError(path, None, None, "the file has no rows")
    for column in (prompt_key, *REQUIRED_COLUMNS):
        if column not in table.column_names:
            raise DataError(
                path, None, column, f"missing column; the file has {table.column_names}"
            )
    _check_type(path, table, prompt_key, _is_prompt_type, "a list of {role, content} structs")
    _check_type(path, table, "data_source", _is_string, "a string")
    _check_type(
        path, table, "reward_model", _has_ground_truth, "a struct with a 'ground_truth' field"
    )
    if "extra_info" in table.column_names:
        _check_type(path, table, "extra_info", _is_struct_or_null, "a struct")
    if not any_ground_truth:
        truth = table.schema.field("reward_model").type.field("ground_truth").type
        if not (_is_string(truth) or pa.types.is_integer(truth) or pa.types.is_floating(truth)):
            raise DataError(
                path, None, "reward_model",
                f"every row: ground_truth is {truth}; the built-in reward functions compare "
                "the response with a string or number (convert it, or score it with your own "
                "function: custom_reward_function.path)",
            )  # fmt: skip
    for column in table.column_names:
        _check_utf8(path, column, table.column(column))
    return table


def _check_utf8(path: str, column: str, values: pa.ChunkedArray) -> None:
    """Raises DataError naming the first row whose strings are not valid UTF-8 (pyarrow does
    not check when reading; decoding a row later would fail without saying where)."""
    offset = 0
    for chunk in values.chunks:
        try:
            chunk.validate(full=True)
        except pa.ArrowInvalid:
            for i in range(len(chunk)):
                try:
                    chunk.slice(i, 1).validate(full=True)
                except pa.ArrowInvalid as e:
                    raise DataError(path, offset + i, column, f"invalid UTF-8 text ({e})") from e
        offset += len(chunk)


def _check_type(path, table, column, ok, expected):
    arrow_type = table.schema.field(column).type
    if not ok(arrow_type):
        raise DataError(path, None, column, f"every row: expected {expected}, got {arrow_type}")


def _is_string(t: pa.DataType) -> bool:
    return pa.types.is_string(t) or pa.types.is_large_string(t)


def _is_prompt_type(t: pa.DataType) -> bool:
    if not (pa.types.is_list(t) or pa.types.is_large_list(t)):
        return False
    item = t.value_type
    if not pa.types.is_struct(item):
        return False
    names = {item.field(i).name: item.field(i).type for i in range(item.num_fields)}
    return all(k in names and _is_string(names[k]) for k in ("role", "content"))


def _has_ground_truth(t: pa.DataType) -> bool:
    return pa.types.is_struct(t) and t.get_field_index("ground_truth") >= 0


def _is_struct_or_null(t: pa.DataType) -> bool:
    return pa.types.is_struct(t) or pa.types.is_null(t)


def check_row(path: str, row: int, prompt_key: str, record: dict) -> None:
    """Checks the values of one row (types were checked per column by `read_table`).

    Raises:
      DataError: a null `data_source` or ground truth, an empty prompt, a message whose role or
        content is null.
    """
    if record.get("data_source") is None:
        raise DataError(path, row, "data_source", "is null")
    messages = record.get(prompt_key)
    if not messages:
        raise DataError(path, row, prompt_key, "has no messages")
    for i, message in enumerate(messages):
        if message is None or message.get("role") is None or message.get("content") is None:
            raise DataError(path, row, prompt_key, f"message {i} lacks a role or content")
    reward_model = record.get("reward_model") or {}
    if reward_model.get("ground_truth") is None:
        raise DataError(path, row, "reward_model", "ground_truth is null")
