"""Load and save HF checkpoints (`config.json` + `*.safetensors`) for our decoder models.

Loading builds the module abstractly (`nnx.eval_shape`: no memory), then fills each parameter
one tensor at a time: read on the host with `safetensors.safe_open`, reshape/transpose to our
layout, cast to `param_dtype`, place on devices with its target sharding. Host memory holds one
tensor at a time, never the whole model.

Our layout differs from HF's only by transposes and reshapes of the same numbers:

  HF tensor                                    ours
  `*.q_proj.weight` (H·Dh, D)                 `q_proj` (D, H, Dh)   (k/v: K instead of H)
  `*.o_proj.weight` (D, H·Dh)                 `o_proj` (H, Dh, D)
  `*.q_proj.bias`   (H·Dh,)                   `q_bias` (H, Dh)
  `*_proj.weight` of the MLP (out, in)         (in, out)
  `lm_head.weight` (V, D), `score.weight` (L, D)   (D, V), (D, L)
  `score.bias` (L,) of `*ForTokenClassification`  `score_bias` (L,)
  embeddings, norm weights, MoE router `mlp.gate.weight` (E, D)   unchanged
  `*.mlp.experts.{e}.gate_proj.weight` (F, D), e < E   `mlp.experts.gate_proj` (E, D, F)
                                               (stacked; up_proj alike, down_proj (E, F, D))
  `model.layers.{i}.<name>`, i < L, of a scanned model   `model.layers.<name>` (L, ...)
                                               (stacked: `ModelConfig.scan_layers`)

A stacked parameter is read one HF tensor at a time into one host array of its full shape,
and written back one layer (one expert) at a time.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import pathlib
from collections.abc import Callable, Iterable, Iterator
from typing import Any, Literal, cast, overload

import jax
import numpy as np
from flax import nnx
from safetensors import SafetensorError, safe_open
from safetensors.numpy import save_file

from hybridjax.errors import InputFileError, MissingFileError, read_json
from hybridjax.models.config import FAMILY_PREFIX, ModelConfig, to_dtype
from hybridjax.models.decoder import INIT_STD, CausalLM, SequenceClassifier

log = logging.getLogger(__name__)

CONFIG_FILE = "config.json"
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
DEFAULT_MAX_SHARD_SIZE_BYTES = 5_000_000_000  # HF's long-standing default ("5GB")

MODEL_KINDS = {"causal_lm": CausalLM, "classifier": SequenceClassifier}

# (logical axes, global shape) -> where the parameter lives.
ShardingFn = Callable[[tuple[str | None, ...], tuple[int, ...]], jax.sharding.Sharding]

# HF tensors that carry nothing we need (buffers saved by old transformers versions).
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


# --------------------------------------------------------------------------- name/layout map


def hf_name(path: tuple[Any, ...]) -> str:
    """HF tensor name of our parameter at `path` (an NNX state path), e.g.
    ('model', 'layers', 0, 'self_attn', 'q_bias') -> 'model.layers.0.self_attn.q_proj.bias'."""
    *prefix, leaf = (str(p) for p in path)
    if leaf in ("q_bias", "k_bias", "v_bias"):
        return ".".join([*prefix, f"{leaf[0]}_proj", "bias"])
    if leaf == "score_bias":
        return "score.bias"
    if leaf == "weight":  # RMSNorm scales already carry HF's name.
        return ".".join([*prefix, leaf])
    return ".".join([*prefix, leaf, "weight"])


def _stacked_experts(path: tuple[Any, ...]) -> bool:
    """Whether `path` is a stacked expert weight (leading dim E, one HF tensor per expert)."""
    return len(path) > 1 and str(path[-2]) == "experts"


def _stacked_layers(path: tuple[Any, ...]) -> bool:
    """Whether `path` is a scanned model's stacked layer parameter (`model.layers.self_attn.…`
    with a leading dim L, one HF tensor per layer: `ModelConfig.scan_layers`)."""
    at = path.index("layers") + 1 if "layers" in path else 0
    return 0 < at < len(path) and not isinstance(path[at], int) and not str(path[at]).isdigit()


def _pieces(path: tuple[Any, ...], shape: tuple[int, ...]) -> list[tuple[str, tuple, tuple]]:
    """(HF name, index of the piece in our array, the piece's shape) of every checkpoint tensor
    our parameter at `path` is made of: the whole array, or one piece per stacked layer
    (`model.layers.{i}.…`) and per stacked expert (`….experts.{e}.gate_proj.weight`)."""
    if _stacked_layers(path):
        at = path.index("layers") + 1
        return [
            (name, (i, *index), piece)
            for i in range(shape[0])
            for name, index, piece in _pieces((*path[:at], i, *path[at:]), shape[1:])
        ]
    if _stacked_experts(path):
        *prefix, leaf = (str(p) for p in path)
        names = (".".join([*prefix, str(e), leaf, "weight"]) for e in range(shape[0]))
        return [(name, (e,), shape[1:]) for e, name in enumerate(names)]
    return [(hf_name(path), (), shape)]


def hf_tensors(path: tuple[Any, ...], shape: tuple[int, ...]) -> dict[str, tuple[int, ...]]:
    """HF name -> HF shape of every checkpoint tensor our parameter at `path` is made of: one,
    or one per stacked layer and expert (`_pieces`)."""
    return {name: hf_shape(path, piece) for name, _, piece in _pieces(path, shape)}


def _read_param(reader, path: tuple[Any, ...], shape: tuple[int, ...], dtype) -> np.ndarray:
    """Our parameter at `path` from the checkpoint, in our layout (layers and experts
    stacked) and `dtype`, read one HF tensor at a time into one host array."""
    pieces = _pieces(path, shape)
    if len(pieces) == 1 and not pieces[0][1]:
        return from_hf_layout(reader.get(pieces[0][0]), path, shape).astype(dtype, copy=False)
    out = np.empty(shape, dtype)
    for name, index, piece in pieces:
        out[index] = from_hf_layout(reader.get(name), path, piece)
    return out


def _hf_param_tensors(array: np.ndarray, path: tuple[Any, ...]) -> dict[str, np.ndarray]:
    """Our parameter's HF tensors by name (inverse of `_read_param`)."""
    return {name: to_hf_layout(array[index], path) for name, index, _ in _pieces(path, array.shape)}


def _input_dims(path: tuple[Any, ...]) -> int | None:
    """How many leading dims of our tensor are the input of a linear map (HF stores linear
    weights as (out, in) matrices), or None if the tensor is stored in HF's order."""
    leaf = str(path[-1])
    if leaf == "o_proj":
        return 2
    if leaf.endswith("_proj") or leaf in ("lm_head", "score"):
        return 1
    return None  # embeddings, norms, biases: same order, biases flattened


def hf_shape(path: tuple[Any, ...], shape: tuple[int, ...]) -> tuple[int, ...]:
    """The HF checkpoint shape of our parameter of shape `shape` at `path`."""
    n_in = _input_dims(path)
    if n_in is not None:
        return (math.prod(shape[n_in:]), math.prod(shape[:n_in]))
    if str(path[-1]).endswith("_bias"):
        return (math.prod(shape),)
    return tuple(shape)


def from_hf_layout(array: np.ndarray, path: tuple[Any, ...], shape: tuple[int, ...]) -> np.ndarray:
    """HF tensor -> our layout (a transpose and/or reshape; copies at most once)."""
    if _input_dims(path) is not None:
        array = array.T
    return np.ascontiguousarray(array.reshape(shape))


def to_hf_layout(array: np.ndarray, path: tuple[Any, ...]) -> np.ndarray:
    """Our tensor -> HF layout (inverse of `from_hf_layout`)."""
    shape = hf_shape(path, array.shape)
    n_in = _input_dims(path)
    if n_in is not None:
        return np.ascontiguousarray(array.reshape(shape[1], shape[0]).T)
    return np.ascontiguousarray(array.reshape(shape))


# --------------------------------------------------------------------------- reading


def read_hf_config(path: str | pathlib.Path) -> dict[str, Any]:
    """The parsed `config.json` of checkpoint directory `path`.

    Raises:
      MissingFileError (a FileNotFoundError): no such file (names it).
      InputFileError: not valid JSON (names the file, line and column) or not a JSON object.
    """
    file = pathlib.Path(path) / CONFIG_FILE
    if not file.is_file():
        raise MissingFileError(f"no HF config: {file} does not exist")
    config = read_json(file)
    if not isinstance(config, dict):
        raise InputFileError(f"{file}: expected a JSON object, got {type(config).__name__}")
    return config


def model_config_from_checkpoint(path: str | pathlib.Path, **overrides: Any) -> ModelConfig:
    """The `ModelConfig` of checkpoint directory `path` with `overrides` applied.

    Raises:
      MissingFileError / InputFileError: see `read_hf_config`; an architecture or setting
        hybridjax does not support (names `config.json` and lists what is supported).
    """
    hf_config = read_hf_config(path)
    try:
        return ModelConfig.from_hf_dict(hf_config, **overrides)
    except (ValueError, TypeError, KeyError) as err:
        raise InputFileError(f"{pathlib.Path(path) / CONFIG_FILE}: {err}") from err


class CheckpointReader:
    """Tensors of a single-file or sharded (`model.safetensors.index.json`) checkpoint, read one
    at a time. Use as a context manager; shard files are opened lazily and memory-mapped."""

    def __init__(self, path: str | pathlib.Path):
        self.path = pathlib.Path(path)
        self._stack = contextlib.ExitStack()
        self._open: dict[pathlib.Path, Any] = {}
        index, single = self.path / INDEX_FILE, self.path / SINGLE_FILE
        if index.is_file():
            weight_map = read_json(index)
            if not isinstance(weight_map, dict) or "weight_map" not in weight_map:
                raise InputFileError(f"{index}: no 'weight_map' object")
            weight_map = weight_map["weight_map"]
            self.files = {name: self.path / file for name, file in weight_map.items()}
        elif single.is_file():
            self.files = {name: single for name in self._handle(single).keys()}
        else:
            raise MissingFileError(f"no safetensors weights: neither {single} nor {index} exists")

    def __enter__(self) -> CheckpointReader:
        return self

    def __exit__(self, *exc) -> None:
        self._stack.close()

    def _handle(self, file: pathlib.Path):
        if file not in self._open:
            if not file.is_file():
                raise MissingFileError(
                    f"checkpoint shard {file} (listed in {INDEX_FILE}) is missing"
                )
            with _readable(file):
                self._open[file] = self._stack.enter_context(
                    safe_open(str(file), framework="numpy")
                )
        return self._open[file]

    def names(self) -> list[str]:
        return list(self.files)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._handle(self.files[name]).get_slice(name).get_shape())

    def get(self, name: str) -> np.ndarray:
        """One tensor as a host numpy array in the checkpoint's dtype (bf16 via ml_dtypes)."""
        with _readable(self.files[name], name):
            return self._handle(self.files[name]).get_tensor(name)

    def dtype(self, name: str) -> str:
        """The tensor's safetensors dtype name (`F32`, `BF16`, `I32`, ...)."""
        return str(self._handle(self.files[name]).get_slice(name).get_dtype())


@contextlib.contextmanager
def _readable(file: pathlib.Path, tensor: str = "") -> Iterator[None]:
    """Reports a truncated or corrupt safetensors file as an InputFileError naming it."""
    try:
        yield
    except SafetensorError as err:
        what = f" (tensor {tensor!r})" if tensor else ""
        raise InputFileError(
            f"{file}{what}: not a readable safetensors file ({err}); the file may be truncated "
            "(an interrupted download or copy): fetch it again"
        ) from err


FLOAT_DTYPES = ("F64", "F32", "F16", "BF16")


def check_float_dtypes(reader: CheckpointReader, names: Iterable[str]) -> None:
    """Raises InputFileError naming the file and every tensor of `names` that is not floating
    point (an integer or boolean tensor would be cast silently into meaningless weights)."""
    bad = [(n, reader.dtype(n)) for n in names if reader.dtype(n) not in FLOAT_DTYPES]
    if bad:
        listed = ", ".join(f"{n!r} ({d}, in {reader.files[n].name})" for n, d in bad[:8])
        more = f" and {len(bad) - 8} more" if len(bad) > 8 else ""
        raise InputFileError(
            f"checkpoint {reader.path}: weights must be floating point ({', '.join(FLOAT_DTYPES)});"
            f" found {listed}{more}"
        )


def _check_tensors(
    reader: CheckpointReader,
    expected: dict[str, tuple[int, ...]],
    optional: set[str],
    ignored: set[str],
) -> None:
    """Raises ValueError naming every missing (and not `optional`) or unexpected (and not
    `ignored`) tensor, and every shape mismatch with both shapes."""
    found = set(reader.names())
    problems = []
    for name, shape in expected.items():
        if name not in found:
            if name not in optional:
                problems.append(f"missing tensor {name!r} (model expects shape {shape})")
        elif reader.shape(name) != shape:
            problems.append(
                f"tensor {name!r} has shape {reader.shape(name)} in the checkpoint but the model "
                f"expects {shape}"
            )
    for name in sorted(found - set(expected) - ignored):
        problems.append(f"unexpected tensor {name!r} with shape {reader.shape(name)}")
    if problems:
        raise InputFileError(
            f"checkpoint {reader.path} does not match the model:\n  " + "\n  ".join(problems)
        )


def _place(array: np.ndarray, axes, shardings: ShardingFn | None) -> jax.Array:
    """Host array -> device array, with the sharding `shardings(axes, shape)` if given. Each
    process transfers only its addressable pieces (works across hosts)."""
    if shardings is None:
        return jax.device_put(array)
    sharding = shardings(tuple(axes), array.shape)
    return jax.make_array_from_callback(array.shape, sharding, lambda index: array[index])


@overload
def load_pretrained(
    path: str | pathlib.Path,
    *,
    kind: Literal["causal_lm"] = "causal_lm",
    shardings: ShardingFn | None = None,
    config_overrides: dict[str, Any] | None = None,
    init_score_head: bool = False,
    seed: int = 0,
) -> CausalLM: ...


@overload
def load_pretrained(
    path: str | pathlib.Path,
    *,
    kind: Literal["classifier"],
    shardings: ShardingFn | None = None,
    config_overrides: dict[str, Any] | None = None,
    init_score_head: bool = False,
    seed: int = 0,
) -> SequenceClassifier: ...


def load_pretrained(
    path: str | pathlib.Path,
    *,
    kind: Literal["causal_lm", "classifier"] = "causal_lm",
    shardings: ShardingFn | None = None,
    config_overrides: dict[str, Any] | None = None,
    init_score_head: bool = False,
    seed: int = 0,
) -> CausalLM | SequenceClassifier:
    """Loads an HF checkpoint directory into a `CausalLM` or `SequenceClassifier`.

    Args:
      path: directory with `config.json` and `model.safetensors` or a sharded
        `model.safetensors.index.json`. Qwen2 / Qwen3 / Qwen3-MoE / Llama / Mistral `*ForCausalLM`,
        `*ForSequenceClassification` (`score.weight`) and the other `*For*` heads of those families.
      kind: "causal_lm" (actor, reference) or "classifier" (critic, reward model).
      shardings: None (default device) or `fn(logical_axes, shape) -> jax.sharding.Sharding`, called
        once per parameter; see `hybridjax.sharding`.
      config_overrides: `ModelConfig` fields to replace, e.g. `{"param_dtype": "bfloat16",
        "remat": True}`. Tensors are cast to `param_dtype` (default float32) on the host.
      init_score_head: for kind="classifier" only: a checkpoint without `score.weight` (a causal
        LM, as when a critic starts from the actor's weights) gets a fresh head drawn from
        N(0, 0.02²) with `seed`, and its `lm_head.weight` is skipped. Without this flag such a
        checkpoint is an error. A classifier's `num_labels` is read from `score.weight` (1 for a
        fresh head) unless `config_overrides` sets it.

    Returns:
      The module with concrete parameters placed on devices.

    Raises:
      FileNotFoundError: `config.json`, the weights, or a shard listed in the index is missing
        (names the path).
      ValueError: unsupported architecture (lists the supported ones); tensors missing,
        unexpected, or of the wrong shape (names each tensor and both shapes); unknown `kind`.
    """
    if kind not in MODEL_KINDS:
        raise ValueError(f"unknown kind {kind!r}; expected one of {sorted(MODEL_KINDS)}")
    if init_score_head and kind != "classifier":
        raise ValueError("init_score_head=True needs kind='classifier'")
    read_hf_config(path)  # a missing or malformed config.json is named before the weights
    overrides = dict(config_overrides or {})
    with CheckpointReader(path) as reader:
        new_head = init_score_head and "score.weight" not in reader.names()
        if kind == "classifier":
            # HF omits num_labels from config.json when it is its default (2): trust the tensor.
            has_head = "score.weight" in reader.names()
            overrides.setdefault("num_labels", reader.shape("score.weight")[0] if has_head else 1)
        config = model_config_from_checkpoint(path, **overrides)
        cls = MODEL_KINDS[kind]
        abstract = nnx.eval_shape(lambda: cls(config, nnx.Rngs(0)))
        graphdef, state = nnx.split(abstract)
        params = list(nnx.to_flat_state(state))
        expected = {n: s for p, v in params for n, s in hf_tensors(p, v.get_value().shape).items()}
        optional = {"score.weight"} if new_head else set()
        ignored = {n for n in reader.names() if n.endswith(_IGNORED_SUFFIXES)}
        if config.tie_word_embeddings or new_head:
            ignored.add("lm_head.weight")  # tied: HF drops it; fresh critic: not ours
        _check_tensors(reader, expected, optional, ignored)
        check_float_dtypes(reader, [n for n in expected if n in reader.files])
        dtype = to_dtype(config.param_dtype)
        for p, var in params:
            shape = var.get_value().shape
            if all(name in reader.files for name in hf_tensors(p, shape)):
                value = _read_param(reader, p, shape, dtype)
            else:  # only a fresh score head gets here
                name = hf_name(p)
                log.warning("%s has no %s: initialising a new head of shape %s", path, name, shape)
                value = INIT_STD * np.random.default_rng(seed).standard_normal(shape)
            axes = var.get_metadata()["axes"]
            var.set_value(_place(value.astype(dtype, copy=False), axes, shardings))
    return cast(CausalLM | SequenceClassifier, nnx.merge(graphdef, state))


# --------------------------------------------------------------------------- writing


def _gather(array: jax.Array) -> np.ndarray:
    """Whole array on this host (a collective when the array spans several processes)."""
    if array.is_fully_addressable:
        return np.asarray(jax.device_get(array))
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(array, tiled=True))


def _plan_shards(sizes: dict[str, int], max_bytes: int) -> list[list[str]]:
    """Greedy split of tensor names (in order) into files of at most `max_bytes` (a tensor
    larger than that gets a file of its own)."""
    shards: list[list[str]] = [[]]
    total = 0
    for name, size in sizes.items():
        if shards[-1] and total + size > max_bytes:
            shards.append([])
            total = 0
        shards[-1].append(name)
        total += size
    return shards


def _architecture(model: CausalLM | SequenceClassifier) -> str:
    prefix = FAMILY_PREFIX[model.config.family]
    if isinstance(model, CausalLM):
        return prefix + "ForCausalLM"
    return prefix + (
        "ForTokenClassification" if model.config.score_bias else "ForSequenceClassification"
    )


def _iter_params(model) -> Iterator[tuple[tuple[Any, ...], Any]]:
    yield from nnx.to_flat_state(nnx.state(model, nnx.Param))


def save_pretrained(
    model: CausalLM | SequenceClassifier,
    path: str | pathlib.Path,
    *,
    max_shard_size_bytes: int = DEFAULT_MAX_SHARD_SIZE_BYTES,
) -> None:
    """Writes `model` as an HF checkpoint that `transformers` `from_pretrained` loads.

    Files: `config.json` and `model.safetensors`, or `model-0000i-of-0000n.safetensors` plus
    `model.safetensors.index.json` when the tensors exceed `max_shard_size_bytes`. Tensors keep
    the parameter dtype. Tied embeddings are written once (no `lm_head.weight`, as HF does).
    Parameters are gathered to the host one at a time; host memory peaks at one file's worth.
    Every process must call this (gathering is collective); only process 0 writes.
    """
    path = pathlib.Path(path)
    params = {hf_name(p): (p, v) for p, v in _iter_params(model)}
    sizes = {name: v.get_value().nbytes for name, (_, v) in params.items()}
    shards = _plan_shards(sizes, max_shard_size_bytes)
    n = len(shards)
    files = (
        [SINGLE_FILE] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
    )
    writer = jax.process_index() == 0
    if writer:
        path.mkdir(parents=True, exist_ok=True)
        for stale in [*path.glob("model*.safetensors"), path / INDEX_FILE]:
            stale.unlink(missing_ok=True)  # weights of an earlier save would shadow ours
    for file, names in zip(files, shards, strict=True):
        tensors = {}
        for name in names:
            p, var = params[name]
            tensors.update(_hf_param_tensors(_gather(var.get_value()), p))
        if writer:
            save_file(tensors, str(path / file), metadata={"format": "pt"})
        del tensors
    if not writer:
        return
    if n > 1:
        index = {
            "metadata": {"total_size": sum(sizes.values())},
            "weight_map": {
                hf: f
                for f, names in zip(files, shards, strict=True)
                for n in names
                for hf in hf_tensors(params[n][0], params[n][1].get_value().shape)
            },
        }
        (path / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    hf_config = model.config.to_hf_dict(_architecture(model))
    (path / CONFIG_FILE).write_text(json.dumps(hf_config, indent=2, sort_keys=True) + "\n")
