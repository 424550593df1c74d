"""Live bytes of a training-side stage per device, counted from shapes (the planner's scratch).

`hybridjax.plan` sums what stays resident between stages from shard shapes; what a stage
allocates while it runs (its scratch) is counted here from the model's shapes, the mesh and
the loop step the stage runs (one packed buffer or one padded micro-batch), the way a fusing
compiler (XLA on GPU) keeps it live. Bytes per device, for one loop step at its peak:

* gathered weights: FSDP all-gathers one layer's weights (and the embedding / LM head) in the
  parameter dtype (a scanned model's stacked weights one layer's slice per scan step: the
  same bytes), casts them to the compute dtype, and in an update holds their gradient in
  the compute dtype and, unsharded, in float32 until it is reduce-scattered. Only the copies
  that exist are counted (no gather without FSDP, no cast when the dtypes agree); weights stay
  split over `tensor`, and MoE experts over `expert` (E/ep experts per device). With the
  vocab-parallel head (`vocab_axes`: the fused head on a mesh that splits the vocabulary,
  `hybridjax.models.logprobs.vocab_split`) the embedding and LM head are never gathered: they
  count at their shard size (the head's copy relaid over the vocabulary axes, its cast and
  gradient), and a chunk's hidden states, gathered over the vocabulary axes other than
  `tensor` (and in an update their gradient), count under "logits".
* activations: per token a layer holds about 6 hidden-size vectors (residual, norms, attention
  input and output, MLP output) and 3 MLP-size ones (gate, up, their product) in the compute
  dtype (a mixture-of-experts layer instead: its k routed copies of the token and their
  outputs, 3 · k expert-width vectors, and the router's E float32 probabilities; with expert
  parallelism (`expert` axis ep > 1) the layer all-gathers the tokens of its `expert` group
  and runs its experts over all of them, so all but the probabilities count ep times; the
  larger of the two counts when the model has both kinds of layer); q, k, v and the
  attention output; with the jnp attention (float32, CPU, TPU) two
  float32 query chunks of logits and probabilities (H × T/n × T each, n query chunks) forward,
  all of them backward. A forward pass holds one layer's; an update holds 2 (recomputed
  forward + its gradients), plus each layer's input with rematerialisation
  (`enable_gradient_checkpointing`) or every layer's activations without it. The remat policy
  `dots_with_no_batch_dims` also keeps each layer's projection outputs (`dots_bytes_per_token`:
  q, k, v, the attention's output projection, gate, up and down; the attention's own
  contractions carry batch dimensions and are recomputed).
* logits: float32 over the vocabulary (split over `tensor`) for each position the LM head
  runs on: 2 copies forward (logits, log-softmax; the exponent's sums are fused reductions),
  4 in an update (plus the scatter of the chosen token's gradient and the logits' gradient),
  as many as XLA's buffer assignment of these programs holds at once on CPU. With the fused
  head (`use_fused_kernels`, `hybridjax.models.logprobs`) only one chunk of positions exists
  at a time: rows × `chunk_size` positions, 2 copies forward (logits, probabilities) and 3 in
  an update (the recomputed logits, probabilities and the logits' gradient). The critic's
  scalar head has none.
* gradients (updates): the accumulator over micro-batches and one micro-batch's gradient,
  each the size of the trainable parameters' shards (= AdamW's moments / 2).
* optimizer step (updates): optax's update tree, one copy of the trainable parameters'
  shards (the new parameters and moments are written in place of the old ones: loop carry,
  and the non-finite check of `trainer.update` selects elementwise in the same fusion). It
  runs after the last micro-batch's backward has freed its buffers, so an update's peak is
  gradients + the larger of the two phases; the component is what the optimizer phase needs
  beyond the backward's gathered weights, activations and logits (often 0).

What this leaves out: XLA CPU's own buffers (it fuses less and keeps more intermediates; its
memory analysis is reported beside the count as `xla_cpu_scratch`), allocator fragmentation,
and the runtime's fixed costs (CUDA context, cuDNN and cuBLAS workspaces: hundreds of MB).
docs/memory-planner.md gives the error against measured CPU peaks.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp

F32 = 4
HIDDEN_VECTORS = 6  # hidden-size vectors a layer holds per token (see the module docstring)
MLP_VECTORS = 3  # intermediate-size vectors (gate, up, product)
FORWARD_LOGITS, UPDATE_LOGITS = 2, 4  # float32 vocabulary-size copies per position
FUSED_FORWARD_LOGITS, FUSED_UPDATE_LOGITS = 2, 3  # the same, per position of a fused chunk


@dataclasses.dataclass(frozen=True)
class LoopStep:
    """The work of one iteration of a stage's loop, per device.

    tokens: positions the decoder runs on (a packed buffer: rows × row length; a padded
      micro-batch: rows × (P + R)).
    head_tokens: positions the LM head runs on (packed: every slot; padded: rows × R).
    rows, row_length: attention rows and their length (attention is dense within a row).
    """

    tokens: int
    head_tokens: int
    rows: int
    row_length: int

    @classmethod
    def of(cls, packing, micro_rows: int, prompt: int, response: int) -> LoopStep:
        """From a pass's `PackingConfig` (None: padded micro-batches of `micro_rows` rows per
        device)."""
        if packing is not None:
            t = packing.rows * packing.row_length
            return cls(t, t, packing.rows, packing.row_length)
        rows = max(micro_rows, 1)
        return cls(rows * (prompt + response), rows * response, rows, prompt + response)


def _in_layers(path) -> bool:
    """Whether the leaf at `path` (a jax key path) belongs to the decoder layers: one layer's
    weight (`model.layers.3.…`), a scanned model's stack of all L layers' (`model.layers.…`,
    leading axis `layers`, replicated: the scan gathers one layer's slice at a time), or a
    LoRA adapter of either. Either way the layers' bytes sum to L layers'."""
    return "layers" in jax.tree_util.keystr(path)


def _gathered(
    params: Any, mesh_shape: dict[str, int], vocab_axes: tuple[str, ...] = ()
) -> tuple[int, int]:
    """(bytes of all decoder layers' weights (per-layer or stacked, `_in_layers`), of the
    embedding, LM head and final norm) per device once gathered over FSDP: each weight split
    only over its `tensor` and `expert` mesh axes, the non-layer weights also over
    `vocab_axes` (the vocab-parallel head: never gathered)."""
    layers, outer = 0, 0
    for path, x in jax.tree_util.tree_leaves_with_path(params):
        in_layers = _in_layers(path)
        kept = {"tensor", "expert"} | (set() if in_layers else set(vocab_axes))
        spec = x.sharding.spec if x.sharding is not None else ()
        split = 1
        for axes in spec:
            for axis in (axes,) if isinstance(axes, str) else axes or ():
                split *= mesh_shape[axis] if axis in kept else 1
        nbytes = math.prod(x.shape) * jnp.dtype(x.dtype).itemsize // split
        if in_layers:
            layers += nbytes
        else:
            outer += nbytes
    return layers, outer


def mlp_bytes_per_token(m, tp: int, ep: int = 1) -> int:
    """Live bytes per token of one layer's MLP (see the module docstring), compute dtype;
    `tp`, `ep`: the `tensor` and `expert` axis sizes (each device's MoE experts run over the
    ep× tokens gathered from its `expert` group)."""
    c = jnp.dtype(m.dtype).itemsize
    dense = MLP_VECTORS * m.intermediate_size // tp * c
    if not m.num_moe_layers:
        return dense
    k = m.num_experts_per_tok
    routed = (2 * k * m.hidden_size + MLP_VECTORS * k * m.moe_intermediate_size // tp) * c * ep
    routed += m.num_experts * F32
    return max(routed, dense if m.num_moe_layers < m.num_hidden_layers else 0)


def dots_bytes_per_token(m, tp: int) -> int:
    """Bytes per token a layer keeps under the remat policy `dots_with_no_batch_dims`
    (`jax.checkpoint_policies.dots_with_no_batch_dims_saveable`), compute dtype: the outputs of
    its weight matmuls, q/k/v ((H + 2K) heads × head_dim, heads split over `tp`), o_proj and
    down_proj (hidden size each), gate and up (intermediate size each, split over `tp`). A
    MoE layer's expert matmuls contract per expert (a batch dimension) and are recomputed."""
    c = jnp.dtype(m.dtype).itemsize
    heads, kv = m.num_attention_heads // tp, max(m.num_key_value_heads // tp, 1)
    qkv = (heads + 2 * kv) * m.resolved_head_dim
    mlp = 2 * m.intermediate_size // tp if m.num_moe_layers < m.num_hidden_layers else 0
    return (qkv + 2 * m.hidden_size + mlp) * c


def stage_bytes(
    kind: str,
    model_config,
    params: Any,
    mesh_shape: dict[str, int],
    step: LoopStep,
    attention: str,
    with_head: bool = True,
    opt_state_bytes: int = 0,
    head_chunk: int = 0,
    vocab_axes: tuple[str, ...] = (),
) -> dict[str, int]:
    """Scratch per device of one stage, by component (see the module docstring).

    Args:
      kind: "forward" (log-prob / value passes) or "update".
      model_config: the role's ModelConfig (shapes, dtypes, `remat`).
      params: the role's abstract parameters with their training shardings.
      mesh_shape: the training mesh's axis sizes.
      step: one loop iteration's work per device.
      attention: "fused" (the blocked attention of GPU and TPU: no T×T logits per head) or
        "jnp" (CPU's dense attention).
      with_head: the pass runs the LM head over the vocabulary (False: a scalar head).
      opt_state_bytes: the role's optimizer state per device (updates; AdamW's two moments,
        so the trainable parameters are half of it).
      head_chunk: positions per chunk of the fused LM head (0: full logits, unfused).
      vocab_axes: the mesh axes the fused head splits the vocabulary over (`vocab_split`;
        empty: GSPMD's partitioning, the head gathered over FSDP).
    Returns:
      component name → bytes; the keys are "gathered weights", "activations", "logits" and,
      for updates, "gradients" and "optimizer step".
    Raises:
      ValueError: an unknown `kind` or `attention`.
    """
    if kind not in ("forward", "update") or attention not in ("fused", "jnp"):
        raise ValueError(f"kind {kind!r} (forward|update), attention {attention!r} (fused|jnp)")
    m, update = model_config, kind == "update"
    c = jnp.dtype(m.dtype).itemsize
    p = jnp.dtype(m.param_dtype).itemsize
    tp = mesh_shape.get("tensor", 1)
    sharded = mesh_shape.get("fsdp", 1) > 1
    cast = m.dtype != m.param_dtype
    vocab_axes = vocab_axes if head_chunk > 0 and with_head else ()
    layer_w, outer_w = _gathered(params, mesh_shape, vocab_axes)
    per_weight_byte = (sharded + cast * c / p) + update * (cast * c / p + sharded * F32 / p)
    gathered = int((layer_w // m.num_hidden_layers + outer_w) * per_weight_byte)

    t, d, hd = step.tokens, m.hidden_size, m.resolved_head_dim
    heads, kv = m.num_attention_heads // tp, max(m.num_key_value_heads // tp, 1)
    ep = mesh_shape.get("expert", 1)
    layer = t * (HIDDEN_VECTORS * d * c + mlp_bytes_per_token(m, tp, ep))
    layer += t * 2 * (heads + kv) * hd * c  # q, k, v and the attention output
    if attention == "jnp":
        chunks = min(4, max(step.row_length // 64, 1))  # decoder.MAX/MIN_QUERY_CHUNK(S)
        scores = step.rows * heads * step.row_length**2 * F32
        layer += scores * (1 if update else 2 / chunks)
    if not update:
        activations = layer
    elif m.remat:
        kept = d * c + (dots_bytes_per_token(m, tp) if m.remat_policy != "full" else 0)
        activations = m.num_hidden_layers * t * kept + 2 * layer
    else:
        activations = (m.num_hidden_layers + 1) * layer
    copies, head_tokens = (UPDATE_LOGITS if update else FORWARD_LOGITS), step.head_tokens
    if head_chunk > 0:
        copies = FUSED_UPDATE_LOGITS if update else FUSED_FORWARD_LOGITS
        rows = max(step.rows, 1)
        head_tokens = rows * min(head_chunk, -(-step.head_tokens // rows))
    logits = head_tokens * (-(-m.vocab_size // tp) if with_head else 1) * F32 * copies
    row_group = math.prod(mesh_shape[a] for a in vocab_axes if a != "tensor")
    if row_group > 1:  # a chunk's hidden states gathered over the vocabulary axes (+ gradient)
        logits += head_tokens * row_group * d * c * (1 + update)
    out = {"gathered weights": gathered, "activations": activations, "logits": logits}
    if update:
        out["gradients"] = opt_state_bytes  # accumulator + one micro-batch's (AdamW: 2 moments)
        backward = gathered + activations + logits
        out["optimizer step"] = max(opt_state_bytes // 2 - backward, 0)
    return out
