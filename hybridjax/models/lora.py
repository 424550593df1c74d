"""LoRA (Hu et al. 2022, arXiv:2106.09685) on the decoder's linear maps, for RL, SFT and DPO.

A targeted weight W (our layout: input dims first, see `hybridjax.models.hf_io`) is used as

    W' = W + (alpha / rank) · reshape(A @ B),    A: in × rank,  B: rank × out

with `in` / `out` the flattened input / output dims (q_proj (D,H,Dh): in D, out H·Dh; o_proj
(H,Dh,D): in H·Dh, out D). B starts at zero, so training starts from the base model exactly.

**Implementation: Flax NNX's own `nnx.LoRA`** holds each adapter pair. Why this and not qwix
(which Tunix uses): `nnx.LoRA` ships with Flax (no new dependency), its parameters are
`nnx.LoRAParam`, a `Param` subtype, so one NNX filter (`nnx.split_state(state, nnx.LoRAParam,
...)`) separates what trains from what is frozen, and its A/B layout is peft's transposed, which
makes export a transpose. qwix attaches adapters by intercepting `einsum`/`dot_general` calls
and finding the weight operand by identity; our decoder reads weights through `.astype` and
stacks gate/up into one einsum, which that interception would miss without an error.
`nnx.LoRA.__call__` (x @ A @ B) is not used: the decoder's projections are einsums over
multi-dimensional weights, so `LoRAModel` applies the adapters by merging them into the weights
inside the forward (`merged_weight`). That keeps the decoder untouched and the same code path as
the rollout's merged weights; its cost: each forward holds the merged target weights (one
transient copy in the compute dtype) and the backward forms each target's weight-sized gradient
before contracting it into dA, dB (the same matmul FLOPs as full fine-tuning). What LoRA saves
here is memory: gradients and optimizer state exist for the adapters only.

The adapters, `LoRAScale` (alpha/rank, 0 = adapters off) and the base model are one NNX module,
so one `nnx.State` flows through the trainer's jitted stages unchanged:
  * trainable / frozen: `split_trainable`, `merge_trainable` (only `nnx.LoRAParam` leaves get
    gradients and optimizer state);
  * reference policy: `adapters_off(state)`, the same base arrays with the scale at 0 (no copy);
  * rollout: `hybridjax.sharding.update_weights` writes W' straight into the generation layout,
    one weight at a time, and sets the copy's scale to 0 (its `decode` reads the base weights);
  * export: `merged_model` (an HF checkpoint via `save_pretrained`) or `save_peft_adapter`
    (`adapter_model.safetensors` + `adapter_config.json`, loaded by `peft.PeftModel`).
"""

from __future__ import annotations

import dataclasses
import json
import math
import pathlib
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec
from safetensors.numpy import save_file

from hybridjax.models.decoder import CausalLM, stack_modules
from hybridjax.models.hf_io import _input_dims, _stacked_experts, _stacked_layers, hf_name

# peft's "all-linear" on these models: every projection of attention and MLP, not the LM head.
LINEAR_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclasses.dataclass(frozen=True)
class LoRAConfig:
    """verl's `model.lora_rank` (0 = no LoRA), `lora_alpha`, `target_modules`; and peft's
    `modules_to_save`: top-level parameters of the base trained in full (the critic's new value
    head, `("score",)`, which also covers `score_bias`)."""

    rank: int = 0
    alpha: float = 16.0
    target_modules: tuple[str, ...] = LINEAR_MODULES
    modules_to_save: tuple[str, ...] = ()

    @property
    def enabled(self) -> bool:
        return self.rank > 0

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    @classmethod
    def from_config(cls, model_cfg: Any, where: str = "actor_rollout_ref.model") -> LoRAConfig:
        """From a ConfigDict holding `lora_rank`, `lora_alpha`, `target_modules` ("all-linear",
        a comma-separated string or a list of projection names).

        Raises:
          ValueError: rank < 0, alpha <= 0, or an unknown module name (lists the valid ones).
        """
        rank, alpha = int(model_cfg.lora_rank), float(model_cfg.lora_alpha)
        targets = model_cfg.target_modules
        if isinstance(targets, str):
            targets = LINEAR_MODULES if targets == "all-linear" else targets.split(",")
        targets = tuple(t.strip() for t in targets if t.strip())
        unknown = [t for t in targets if t not in LINEAR_MODULES]
        problems = []
        if rank < 0:
            problems.append(f"{where}.lora_rank must be >= 0, got {rank}")
        if rank and alpha <= 0:
            problems.append(f"{where}.lora_alpha must be > 0, got {alpha}")
        if unknown or (rank and not targets):
            problems.append(
                f"{where}.target_modules: unknown {unknown or 'empty'} (use 'all-linear' or "
                f"names from {list(LINEAR_MODULES)})"
            )
        if problems:
            raise ValueError("; ".join(problems))
        return cls(rank, alpha, targets)


class LoRAScale(nnx.Variable):
    """alpha / rank as a float32 scalar in the state (0 turns the adapters off)."""


def merged_weight(w: jax.Array, a: jax.Array, b: jax.Array, scale: jax.Array) -> jax.Array:
    """W + scale · reshape(A @ B, W.shape), summed in float32, returned in W's dtype. A stacked
    weight (L, ...) takes stacked adapters A (L, in, rank), B (L, rank, out): one product per
    layer."""
    delta = jnp.matmul(a.astype(jnp.float32), b.astype(jnp.float32)) * scale
    return (w.astype(jnp.float32) + delta.reshape(w.shape)).astype(w.dtype)


def _key(path: Sequence[Any]) -> str:
    return ".".join(str(p) for p in path)


def _adapter(path: tuple, shape: tuple[int, ...], dtype, rank: int, rngs: nnx.Rngs) -> nnx.LoRA:
    """A fresh adapter pair for one weight of `shape` (our layout) at `path`."""
    n_in = _input_dims(path)
    fan_in, fan_out = math.prod(shape[:n_in]), math.prod(shape[n_in:])
    return nnx.LoRA(fan_in, rank, fan_out, param_dtype=dtype, rngs=rngs)


def _adapters(base: nnx.Module, config: LoRAConfig, rngs: nnx.Rngs) -> dict[str, nnx.LoRA]:
    """Target weight key -> its adapters. A scanned model's stacked layer weight (L, ...)
    gets L adapters stacked on a leading axis (`decoder.stack_modules`), drawn layer by layer
    in the per-layer model's order, so both models start from the same adapters. Stacked MoE
    experts (E, in, out) are not adapted: one adapter per expert is not implemented;
    attention and dense MLPs of an MoE model are."""
    targets = [
        (path, var.get_value())
        for path, var in nnx.to_flat_state(nnx.state(base, nnx.Param))
        if str(path[-1]) in config.target_modules and not _stacked_experts(path)
    ]
    out = {
        _key(p): _adapter(p, w.shape, w.dtype, config.rank, rngs)
        for p, w in targets
        if not _stacked_layers(p)
    }
    stacked = [(p, w) for p, w in targets if _stacked_layers(p)]
    per_layer: dict[str, list[nnx.LoRA]] = {_key(p): [] for p, _ in stacked}
    for _ in range(stacked[0][1].shape[0] if stacked else 0):
        for p, w in stacked:
            per_layer[_key(p)].append(_adapter(p, w.shape[1:], w.dtype, config.rank, rngs))
    return out | {key: stack_modules(layers) for key, layers in per_layer.items()}


class LoRAModel(nnx.Module):
    """A `CausalLM` (or the critic's `SequenceClassifier`) with LoRA adapters on
    `config.target_modules` of every layer; the base's `config.modules_to_save` parameters become
    `nnx.LoRAParam`s in place, so they train (and are checkpointed) with the adapters.

    Same surface as the wrapped model for the trainer: `model` (the backbone with merged
    weights), `logits` (the LM head is never adapted), `__call__` (merged forward) and `decode`,
    which reads the *base* weights only: it runs on the generation copy, where `update_weights`
    has already merged the adapters into them.
    """

    def __init__(self, base: CausalLM, config: LoRAConfig, rngs: nnx.Rngs):
        self.base = base
        self.config = base.config
        self.lora = config
        self.adapters = nnx.Dict(_adapters(base, config, rngs))
        for name in vars(base).copy():
            var = getattr(base, name)
            if isinstance(var, nnx.Param) and name.removesuffix("_bias") in config.modules_to_save:
                setattr(base, name, nnx.LoRAParam(var.get_value(), **var.get_metadata()))
        self.scale = LoRAScale(jnp.float32(config.scale))

    def merged(self) -> CausalLM:
        """The base model with every adapter merged into its weight (a new module)."""
        graphdef, state = nnx.split(self.base)
        flat = dict(nnx.to_flat_state(state))
        for path, var in flat.items():
            if (adapter := self.adapters.get(_key(path))) is not None:
                w = merged_weight(
                    var.get_value(), adapter.lora_a[...], adapter.lora_b[...], self.scale[...]
                )
                flat[path] = var.replace(w)
        return nnx.merge(graphdef, nnx.from_flat_state(flat))

    @property
    def model(self):
        return self.merged().model

    def logits(self, hidden_BxTxD: jax.Array) -> jax.Array:
        return self.base.logits(hidden_BxTxD)

    def head_weight(self) -> tuple[jax.Array, str]:
        return self.base.head_weight()

    def __call__(self, *args, **kwargs) -> jax.Array:
        return self.merged()(*args, **kwargs)

    def decode(self, *args, **kwargs):
        return self.base.decode(*args, **kwargs)


def apply_lora(base: CausalLM, config: LoRAConfig, seed: int = 0) -> LoRAModel:
    """Wraps `base` with fresh adapters (A he-uniform, B zero), placed replicated on the mesh of
    `base`'s weights (they are small: rank × (in + out) per target)."""
    model = LoRAModel(base, config, nnx.Rngs(seed))
    sharding = jax.tree.leaves(nnx.state(base))[0].sharding
    if isinstance(sharding, NamedSharding):
        replicated = NamedSharding(sharding.mesh, PartitionSpec())
        small = nnx.state(model, nnx.Not(nnx.PathContains("base")))
        nnx.update(model, jax.device_put(small, replicated))
    return model


# ------------------------------------------------------------------------- states


def has_adapters(state: Any) -> bool:
    """Whether an `nnx.State` holds LoRA parameters."""
    return isinstance(state, nnx.State) and any(
        isinstance(v, nnx.LoRAParam) for _, v in nnx.to_flat_state(state)
    )


def split_trainable(state: Any) -> tuple[Any, Any]:
    """(trainable, frozen): the `nnx.LoRAParam` leaves (adapters and `modules_to_save`) and the
    rest when `state` has adapters, else (state, None)."""
    if not has_adapters(state):
        return state, None
    trainable, frozen = nnx.split_state(state, nnx.LoRAParam, ...)
    return trainable, frozen


def merge_trainable(trainable: Any, frozen: Any) -> Any:
    """Inverse of `split_trainable`."""
    return trainable if frozen is None else nnx.merge_state(trainable, frozen)


def adapters_off(state: Any) -> Any:
    """The same state with `LoRAScale` at 0 (the base model; the arrays are shared, not
    copied). A state without adapters is returned as it is."""
    if not has_adapters(state):
        return state
    return jax.tree.map(
        lambda v: v.replace(v.get_value() * 0) if isinstance(v, LoRAScale) else v,
        state,
        is_leaf=lambda x: isinstance(x, nnx.Variable),
    )


def merge_plan(state: nnx.State) -> tuple[dict[tuple, tuple[tuple, tuple]], tuple]:
    """({target weight path: (lora_a path, lora_b path)}, scale path) of a `LoRAModel` state."""
    flat = dict(nnx.to_flat_state(state))
    scale = next(p for p, v in flat.items() if isinstance(v, LoRAScale))
    plan = {}
    for path in flat:
        if path[0] == "base":
            key = ("adapters", _key(path[1:]))
            if (*key, "lora_a") in flat:
                plan[path] = ((*key, "lora_a"), (*key, "lora_b"))
    return plan, scale


# ------------------------------------------------------------------------- export


def merged_model(model: Any) -> Any:
    """`model` itself, or for a `LoRAModel` its base with the adapters merged: a plain HF
    checkpoint for `save_pretrained`, and the one module a pass runs (and
    `moe.with_router_stats` records) where `LoRAModel.model` would build a new one per call."""
    return model.merged() if isinstance(model, LoRAModel) else model


def _host(x: jax.Array) -> np.ndarray:
    from jax.experimental import multihost_utils

    if not x.is_fully_addressable:
        x = multihost_utils.process_allgather(x, tiled=True)
    return np.asarray(jax.device_get(x))


def _per_layer(path: tuple, adapter: nnx.LoRA) -> list[tuple[tuple, np.ndarray, np.ndarray]]:
    """(target path, A in × rank, B rank × out) on the host for each layer an adapter serves:
    itself, or each layer of a scanned model's stacked adapter (`model.layers.{i}.…`)."""
    a, b = _host(adapter.lora_a[...]), _host(adapter.lora_b[...])
    if not _stacked_layers(path):
        return [(path, a, b)]
    at = path.index("layers") + 1
    return [((*path[:at], str(i), *path[at:]), a[i], b[i]) for i in range(a.shape[0])]


def save_peft_adapter(
    model: LoRAModel, path: str | pathlib.Path, base_model_name_or_path: str = ""
) -> None:
    """Writes the adapters as peft does (`adapter_model.safetensors` + `adapter_config.json`),
    so `peft.PeftModel.from_pretrained(hf_base, path)` rebuilds the same model. Tensor names are
    peft's (`base_model.model.<module>.lora_A.weight`: rank × in, `lora_B.weight`: out × rank),
    one pair per layer also for a scanned model's stacked adapters; the scale is
    `lora_alpha / r` (no rsLoRA). Only process 0 writes."""
    path = pathlib.Path(path)
    tensors = {}
    for key, adapter in model.adapters.items():
        for target, a, b in _per_layer(tuple(key.split(".")), adapter):
            prefix = f"base_model.model.{hf_name(target).removesuffix('.weight')}"
            tensors[f"{prefix}.lora_A.weight"] = np.ascontiguousarray(a.T)
            tensors[f"{prefix}.lora_B.weight"] = np.ascontiguousarray(b.T)
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model_name_or_path or None,
        "r": model.lora.rank,
        "lora_alpha": model.lora.alpha,
        "lora_dropout": 0.0,
        "target_modules": sorted(model.lora.target_modules),
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "modules_to_save": None,
        "inference_mode": True,
    }
    if jax.process_index() != 0:
        return
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "adapter_model.safetensors"), metadata={"format": "pt"})
    (path / "adapter_config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
