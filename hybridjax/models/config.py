"""Model configuration shared by the decoder, the HF loader and the sharding rules."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp

# HF `architectures` values we can load, and the family each belongs to.
SUPPORTED_ARCHITECTURES = {
    "Qwen2ForCausalLM": "qwen2",
    "Qwen2ForSequenceClassification": "qwen2",
    "Qwen2ForTokenClassification": "qwen2",
    "LlamaForCausalLM": "llama",
    "LlamaForSequenceClassification": "llama",
    "LlamaForTokenClassification": "llama",
    "MistralForCausalLM": "mistral",
    "MistralForSequenceClassification": "mistral",
    "MistralForTokenClassification": "mistral",
    "Qwen3ForCausalLM": "qwen3",
    "Qwen3ForSequenceClassification": "qwen3",
    "Qwen3ForTokenClassification": "qwen3",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "Qwen3MoeForSequenceClassification": "qwen3_moe",
    "Qwen3MoeForTokenClassification": "qwen3_moe",
}
# family -> HF class-name prefix (`{prefix}ForCausalLM`, ...)
FAMILY_PREFIX = {
    "qwen2": "Qwen2",
    "llama": "Llama",
    "mistral": "Mistral",
    "qwen3": "Qwen3",
    "qwen3_moe": "Qwen3Moe",
}
# Families whose attention normalises q and k per head (RMSNorm over head_dim) before RoPE.
QK_NORM_FAMILIES = ("qwen3", "qwen3_moe")
# Families whose sliding window follows Qwen2's `use_sliding_window` / `max_window_layers`.
QWEN_WINDOW_FAMILIES = ("qwen2", "qwen3", "qwen3_moe")

_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}
DTYPE_NAMES = tuple(sorted(_DTYPES))  # the dtype names `to_dtype` accepts
AUTO_DTYPE = "auto"  # a config's compute dtype chosen for the backend (`auto_dtype`)
DTYPE_CHOICES = (AUTO_DTYPE, *DTYPE_NAMES)  # what the config's dtype keys accept
ACCELERATORS = ("gpu", "cuda", "rocm", "tpu")  # backends whose matmuls run bfloat16 natively


def auto_dtype(backend: str) -> str:
    """The compute dtype `auto` means on `backend` (`jax.default_backend()`, or the planner's
    `--target`): "bfloat16" on a GPU or TPU (their matrix units' native input type, as
    verl's bf16 FSDP default), "float32" on CPU (exact, and what the CPU tests check)."""
    return "bfloat16" if backend in ACCELERATORS else "float32"


# What a rematerialised layer keeps for the backward pass: "full" only its input (everything
# else recomputed); "dots_with_no_batch_dims" also the outputs of matmuls without a batch
# dimension (`jax.checkpoint_policies.dots_with_no_batch_dims_saveable`: the projections,
# not attention's scores), MaxText's "minimal".
REMAT_POLICIES = ("full", "dots_with_no_batch_dims")
# `ModelConfig.scan_layers`: True, False, or "auto" (resolved at construction: on for dense
# models whose layers are rematerialised, `remat`; off for mixture-of-experts ones, whose dense /
# MoE layers do not stack uniformly, and without remat, where a scan keeps every step's
# residuals in stacked buffers: measured on CPU, the backward of a 4-layer width-256 model over
# 8 × 128 tokens needs 214 MB of temporaries scanned against 153 MB with the loop, and with
# remat 61 MB scanned against 138 MB).
AUTO_SCAN = "auto"


def to_dtype(name: str | Any) -> Any:
    """Turns 'float32' / 'bfloat16' / 'float16' (or a dtype) into a jnp dtype; raises ValueError."""
    if not isinstance(name, str):
        return name
    if name not in _DTYPES:
        raise ValueError(f"unknown dtype {name!r}; expected one of {sorted(_DTYPES)}")
    return _DTYPES[name]


def _token_ids(hf: dict[str, Any], key: str, several: bool = False) -> Any:
    """`hf[key]`: None, an integer token id, or (`several`) a list of them as a tuple; raises
    ValueError naming the key and the value otherwise (a string, a float, a bool)."""
    value = hf.get(key)
    ids = value if several and isinstance(value, list) else [value]
    if value is None or all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        return tuple(value) if isinstance(value, list) else value
    what = "an integer token id" + (" or a list of them" if several else "")
    raise ValueError(f"{key} must be {what} (got {value!r})")


def _rope_from_hf(hf: dict[str, Any]) -> tuple[float, tuple[tuple[str, Any], ...] | None]:
    """(rope_theta, frozen rope_scaling or None) from a v4 (`rope_theta` + `rope_scaling`) or
    v5 (`rope_parameters`, which also holds `rope_theta`) `config.json`."""
    params = dict(hf.get("rope_parameters") or {})
    params.update(hf.get("rope_scaling") or {})
    theta: Any = params.pop("rope_theta", 10000.0)
    theta = hf.get("rope_theta", theta)
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in {"default", "linear", "llama3"}:
        raise ValueError(
            f"unsupported rope_scaling type {rope_type!r}; supported: default, linear, llama3"
        )
    if rope_type == "default":
        return float(theta), None
    params.pop("type", None)
    return float(theta), tuple(sorted({**params, "rope_type": rope_type}.items()))


def _sliding_window_from_hf(hf: dict[str, Any], family: str) -> int | None:
    """The attention window shared by every layer, or None for full attention.

    Mistral applies `sliding_window` whenever it is set. Qwen2 / Qwen3 apply it only with
    `use_sliding_window`, and then only to layers >= `max_window_layers` (HF default 28), or as
    listed in `layer_types`; a mix of windowed and full layers is rejected (ValueError).
    """
    window = hf.get("sliding_window")
    if family not in QWEN_WINDOW_FAMILIES or window is None:
        return window if family == "mistral" else None
    if not hf.get("use_sliding_window", False):
        return None
    n = hf["num_hidden_layers"]
    layer_types = hf.get("layer_types") or [
        "sliding_attention" if i >= hf.get("max_window_layers", 28) else "full_attention"
        for i in range(n)
    ]
    kinds = set(layer_types)
    if kinds == {"full_attention"}:
        return None
    if kinds == {"sliding_attention"}:
        return window
    raise ValueError(f"per-layer sliding windows are not supported (layer_types={layer_types})")


def _moe_from_hf(hf: dict[str, Any]) -> dict[str, Any]:
    """The mixture-of-experts fields of a Qwen3-MoE `config.json` (`num_experts`, or
    `num_local_experts` as transformers 5 writes it)."""
    num_experts = hf.get("num_experts", hf.get("num_local_experts"))
    if not num_experts or not hf.get("num_experts_per_tok"):
        raise ValueError("qwen3_moe needs num_experts and num_experts_per_tok > 0")
    if hf["num_experts_per_tok"] > num_experts:
        raise ValueError(
            f"num_experts_per_tok={hf['num_experts_per_tok']} exceeds num_experts={num_experts}"
        )
    return dict(
        num_experts=num_experts,
        num_experts_per_tok=hf["num_experts_per_tok"],
        moe_intermediate_size=hf["moe_intermediate_size"],
        norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
        decoder_sparse_step=hf.get("decoder_sparse_step", 1),
        mlp_only_layers=tuple(hf.get("mlp_only_layers") or ()),
        router_aux_loss_coef=hf.get("router_aux_loss_coef", 0.001),
    )


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Hyper-parameters of a Qwen2 / Qwen3 / Qwen3-MoE / Llama / Mistral decoder, with HF
    `config.json` names.

    Mixture of experts (Qwen3-MoE, `num_experts > 0`): layer i routes each token to
    `num_experts_per_tok` of `num_experts` SwiGLU experts of width `moe_intermediate_size` when
    i is not in `mlp_only_layers` and (i + 1) % `decoder_sparse_step` == 0 (HF's rule); other
    layers keep the dense MLP of width `intermediate_size`. `router_aux_loss_coef` is carried
    for the HF round trip only: training reads its coefficient from
    `actor_rollout_ref.actor.moe_aux_loss_coeff` (Megatron's name; 0, off, by default).

    `scan_layers` (True, False or "auto": on with `remat` unless `num_experts`) stores the
    decoder layers' parameters stacked on a leading layer axis and runs them as one scan
    (`decoder.Transformer`);
    after construction it is a bool.

    `batch_invariant` (parity mode) runs projections, norms, attention and the LM head in
    an order that does not depend on how many rows share a call (`hybridjax.models.invariant`).

    `param_dtype` is the dtype parameters are stored in; `dtype` the dtype matmuls run in.
    Attention softmax, RMSNorm statistics and RoPE tables are always computed in float32.
    """

    vocab_size: int = 256
    hidden_size: int = 64
    intermediate_size: int = 128
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int | None = None
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    # Frozen tuple of (key, value) pairs of HF's `rope_scaling` dict (hashable), or None.
    rope_scaling: tuple[tuple[str, Any], ...] | None = None
    attention_bias: bool = False
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 2048
    sliding_window: int | None = None
    family: str = "qwen2"
    num_labels: int = 1
    # HF `*ForTokenClassification` heads (verl's critic) have a `score.bias`; sequence ones do not.
    score_bias: bool = False
    bos_token_id: int | None = None
    eos_token_id: int | tuple[int, ...] | None = None
    pad_token_id: int | None = None
    param_dtype: str = "float32"
    dtype: str = "float32"
    remat: bool = False
    # what `remat` saves of each layer for the backward pass (`REMAT_POLICIES`)
    remat_policy: str = "full"
    # store the decoder layers' parameters stacked and run them as one `jax.lax.scan`
    # (`Transformer`); "auto" (AUTO_SCAN) becomes True for dense models with `remat`
    scan_layers: bool | str = False
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    router_aux_loss_coef: float = 0.001
    # parity mode: every row-wise reduction in a fixed order whatever the batch
    # (`hybridjax.models.invariant`), so engine and trainer log-probs agree bit for bit
    batch_invariant: bool = False

    def __post_init__(self):
        """Raises ValueError for an unknown family or an inconsistent mixture of experts."""
        if self.family not in FAMILY_PREFIX:
            raise ValueError(
                f"unknown family {self.family!r}; expected one of {sorted(FAMILY_PREFIX)}"
            )
        if self.num_experts and self.family != "qwen3_moe":
            raise ValueError(f"num_experts={self.num_experts} needs family 'qwen3_moe'")
        if self.family == "qwen3_moe" and not (
            0 < self.num_experts_per_tok <= self.num_experts and self.moe_intermediate_size > 0
        ):
            raise ValueError(
                "qwen3_moe needs 0 < num_experts_per_tok <= num_experts and "
                f"moe_intermediate_size > 0 (got {self.num_experts_per_tok}, {self.num_experts}, "
                f"{self.moe_intermediate_size})"
            )
        if self.decoder_sparse_step < 1:
            raise ValueError(f"decoder_sparse_step must be >= 1, got {self.decoder_sparse_step}")
        if self.remat_policy not in REMAT_POLICIES:
            raise ValueError(
                f"unknown remat_policy {self.remat_policy!r}; expected one of {REMAT_POLICIES}"
            )
        if self.scan_layers == AUTO_SCAN:  # frozen: resolved once, so readers see a bool
            object.__setattr__(self, "scan_layers", self.remat and not self.num_experts)
        if self.scan_layers not in (True, False):
            raise ValueError(
                f"scan_layers must be True, False or {AUTO_SCAN!r}, got {self.scan_layers!r}"
            )
        if self.batch_invariant and self.num_experts:
            raise ValueError(
                "batch_invariant does not cover mixture-of-experts models (num_experts="
                f"{self.num_experts}); set actor_rollout_ref.model.batch_invariant to false"
            )
        if self.scan_layers and self.num_experts:
            raise ValueError(
                "scan_layers=True is not supported for mixture-of-experts models "
                f"(num_experts={self.num_experts}); set actor_rollout_ref.model.scan_layers to "
                "'auto' or 'false'"
            )

    @property
    def qk_norm(self) -> bool:
        """Whether attention applies a per-head RMSNorm to q and k before RoPE (Qwen3)."""
        return self.family in QK_NORM_FAMILIES

    def is_moe_layer(self, layer: int) -> bool:
        """Whether decoder layer `layer` (0-based) has routed experts instead of a dense MLP."""
        return (
            self.num_experts > 0
            and layer not in self.mlp_only_layers
            and (layer + 1) % self.decoder_sparse_step == 0
        )

    @property
    def num_moe_layers(self) -> int:
        return sum(self.is_moe_layer(i) for i in range(self.num_hidden_layers))

    @property
    def resolved_head_dim(self) -> int:
        return self.head_dim or self.hidden_size // self.num_attention_heads

    @property
    def rope_scaling_dict(self) -> dict[str, Any] | None:
        return dict(self.rope_scaling) if self.rope_scaling else None

    def num_params(self, include_embedding: bool = True, active: bool = False) -> int:
        """Number of parameters of the causal LM (embedding counted once when tied); with
        `active`, a MoE layer counts only the `num_experts_per_tok` experts a token uses."""
        d, f, hd = self.hidden_size, self.intermediate_size, self.resolved_head_dim
        h, kv = self.num_attention_heads, self.num_key_value_heads
        attn = d * hd * (h + 2 * kv) + h * hd * d
        if self.attention_bias:
            attn += hd * (h + 2 * kv)
        if self.qk_norm:
            attn += 2 * hd
        experts = self.num_experts_per_tok if active else self.num_experts
        moe_mlp = d * self.num_experts + experts * 3 * d * self.moe_intermediate_size
        n_moe = self.num_moe_layers
        n = n_moe * moe_mlp + (self.num_hidden_layers - n_moe) * 3 * d * f
        n += self.num_hidden_layers * (attn + 2 * d) + d
        if include_embedding:
            n += self.vocab_size * d * (1 if self.tie_word_embeddings else 2)
        return n

    @classmethod
    def from_hf_dict(cls, hf: dict[str, Any], **overrides: Any) -> ModelConfig:
        """Builds a config from a parsed HF `config.json`.

        Raises:
          ValueError: `architectures` names a model we do not support (the message lists the
            supported ones), or the RoPE scaling type is unknown.
        """
        archs = hf.get("architectures") or []
        family = hf.get("model_type")
        if archs:
            unknown = [a for a in archs if a not in SUPPORTED_ARCHITECTURES]
            if unknown:
                raise ValueError(
                    f"unsupported architectures {unknown}; supported: "
                    f"{sorted(SUPPORTED_ARCHITECTURES)}"
                )
            family = SUPPORTED_ARCHITECTURES[archs[0]]
        if family not in FAMILY_PREFIX:
            raise ValueError(
                f"unsupported model_type {family!r}; supported architectures: "
                f"{sorted(SUPPORTED_ARCHITECTURES)}"
            )
        rope_theta, rope = _rope_from_hf(hf)
        if family in ("llama", "qwen3", "qwen3_moe") and hf.get("attention_bias"):
            raise ValueError(f"{family} with attention_bias=true (o_proj bias) is not supported")
        if hf.get("hidden_act", "silu") != "silu":
            raise ValueError(f"unsupported hidden_act {hf['hidden_act']!r}; supported: silu")
        eos = _token_ids(hf, "eos_token_id", several=True)
        kwargs = dict(
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_hidden_layers=hf["num_hidden_layers"],
            num_attention_heads=hf["num_attention_heads"],
            num_key_value_heads=hf.get("num_key_value_heads") or hf["num_attention_heads"],
            head_dim=hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"],
            rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
            rope_theta=rope_theta,
            rope_scaling=rope,
            # Qwen2 always has q/k/v biases; Llama's flag would also add an o_proj bias.
            attention_bias=family == "qwen2" or hf.get("attention_bias", False),
            tie_word_embeddings=hf.get("tie_word_embeddings", False),
            max_position_embeddings=hf.get("max_position_embeddings", 2048),
            sliding_window=_sliding_window_from_hf(hf, family),
            family=family,
            num_labels=hf.get("num_labels", len(hf.get("id2label", {}) or {}) or 1),
            score_bias=bool(archs)
            and archs[0].endswith("ForTokenClassification")
            and hf.get("token_classification_bias", True),
            bos_token_id=_token_ids(hf, "bos_token_id"),
            eos_token_id=eos,
            pad_token_id=_token_ids(hf, "pad_token_id"),
        )
        if family == "qwen3_moe":
            kwargs.update(_moe_from_hf(hf))
        kwargs.update(overrides)
        return cls(**kwargs)

    def to_hf_dict(self, architecture: str | None = None) -> dict[str, Any]:
        """HF `config.json` content for this model (`architecture` defaults to the causal LM)."""
        model_type = self.family
        arch = architecture or FAMILY_PREFIX[model_type] + "ForCausalLM"
        out: dict[str, Any] = {
            "architectures": [arch],
            "model_type": model_type,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.resolved_head_dim,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": self.rope_scaling_dict,
            "tie_word_embeddings": self.tie_word_embeddings,
            "max_position_embeddings": self.max_position_embeddings,
            "hidden_act": "silu",
            "torch_dtype": self.param_dtype,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": list(self.eos_token_id)
            if isinstance(self.eos_token_id, tuple)
            else self.eos_token_id,
            "pad_token_id": self.pad_token_id,
        }
        if model_type in ("llama", "qwen3", "qwen3_moe"):
            out["attention_bias"] = self.attention_bias
        if model_type == "llama":
            out["mlp_bias"] = False
        if model_type in ("mistral", *QWEN_WINDOW_FAMILIES):
            out["sliding_window"] = self.sliding_window
            out["use_sliding_window"] = self.sliding_window is not None
        if model_type == "qwen3_moe":
            out.update(
                num_experts=self.num_experts,
                num_experts_per_tok=self.num_experts_per_tok,
                moe_intermediate_size=self.moe_intermediate_size,
                norm_topk_prob=self.norm_topk_prob,
                decoder_sparse_step=self.decoder_sparse_step,
                mlp_only_layers=list(self.mlp_only_layers),
                router_aux_loss_coef=self.router_aux_loss_coef,
            )
        if model_type in QWEN_WINDOW_FAMILIES:
            # Qwen2 windows only layers >= max_window_layers; ours windows all of them or none.
            out["max_window_layers"] = 0 if self.sliding_window else self.num_hidden_layers
        if "Classification" in arch:
            out["num_labels"] = self.num_labels
            out["id2label"] = {str(i): f"LABEL_{i}" for i in range(self.num_labels)}
            out["label2id"] = {f"LABEL_{i}": i for i in range(self.num_labels)}
        return out
