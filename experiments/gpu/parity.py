"""Step `parity`: logits of small random Qwen2 and Llama models, ours on the GPU through JAX
against `transformers` on the GPU through the image's torch, in float32 and in bfloat16.

Each model is built by `transformers` from a config (random weights drawn with std 0.15, larger
than HF's 0.02, so logits spread and a wrong transpose, rope or mask shows), saved as
safetensors and loaded by `hybridjax.models.load_pretrained`; both run one left-padded batch
with the same position ids. float32 runs with TF32 off on both sides (JAX matmul precision
"highest"); bfloat16 is the weights and activations of each side in bfloat16.

Table, per family and dtype: max |ours − HF float32| and max |ours − HF same dtype| over valid
tokens, each divided by max |HF float32 logit| (the scale), the share of valid tokens whose
argmax agrees with HF float32's, and the limit: 1e-3 of the scale in float32, 5e-2 in bfloat16
(`tests/gpu/test_gpu.py`'s). Skips without torch or transformers; on a GPU machine fails when
torch sees no GPU; fails when a row is over its limit.
"""

from __future__ import annotations

import os
import pathlib
import tempfile

import numpy as np

from experiments.gpu.step import Context, Skip, main

LIMITS = {"float32": 1e-3, "bfloat16": 5e-2}
# small: a few ms a pass on a GPU, with GQA, biases (Qwen2), untied head and llama3 rope (Llama)
SHAPE = dict(
    vocab_size=2048,
    hidden_size=256,
    intermediate_size=512,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=2,
    max_position_embeddings=1024,
    pad_token_id=0,
    initializer_range=0.15,
)
DRY_SHAPE = SHAPE | dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2)
LLAMA3_ROPE = dict(
    rope_type="llama3",
    factor=8.0,
    low_freq_factor=1.0,
    high_freq_factor=4.0,
    original_max_position_embeddings=128,
)


def families(shape: dict) -> dict:
    """family → (HF config, HF causal LM class)."""
    import transformers

    return {
        "qwen2": (
            transformers.Qwen2Config(**shape, tie_word_embeddings=True),
            transformers.Qwen2ForCausalLM,
        ),
        "llama": (
            transformers.LlamaConfig(
                **shape, tie_word_embeddings=False, rope_theta=500000.0, rope_scaling=LLAMA3_ROPE
            ),
            transformers.LlamaForCausalLM,
        ),
    }


def batch(vocab: int, rows: int, length: int) -> tuple[np.ndarray, ...]:
    """(ids, mask, positions), rows×length int64, rows left-padded by 0 … length/2 tokens."""
    rng = np.random.default_rng(2)
    mask = np.ones((rows, length), np.int64)
    for r in range(rows):
        mask[r, : r * length // (2 * rows)] = 0
    ids = rng.integers(1, vocab, mask.shape) * mask
    return ids, mask, np.maximum(np.cumsum(mask, axis=1) - 1, 0)


def hf_logits(model, data, device) -> np.ndarray:
    import torch

    with torch.no_grad():
        ids, mask, pos = (torch.tensor(x, device=device) for x in data)
        out = model(input_ids=ids, attention_mask=mask, position_ids=pos)
    return out.logits.float().cpu().numpy()


def our_logits(path: pathlib.Path, data, dtype: str) -> np.ndarray:
    import jax.numpy as jnp
    from flax import nnx

    from hybridjax.models import load_pretrained

    model = load_pretrained(path, config_overrides={"dtype": dtype})
    forward = nnx.jit(lambda m, ids, mask, pos: m(ids, mask, pos))
    return np.asarray(forward(model, *(jnp.asarray(x) for x in data)), np.float32)


def compare(family: str, config, cls, data, device, folder: pathlib.Path) -> list[list]:
    """The table rows of one family (see the module docstring)."""
    import torch

    torch.manual_seed(0)
    config._attn_implementation = "eager"
    model = cls(config).eval().to(device)
    model.save_pretrained(folder)
    reference = {"float32": hf_logits(model, data, device)}
    reference["bfloat16"] = hf_logits(model.to(torch.bfloat16), data, device)
    valid = data[1].astype(bool)
    scale = float(np.abs(reference["float32"][valid]).max())
    rows = []
    for dtype, limit in LIMITS.items():
        ours = our_logits(folder, data, dtype)
        vs_f32 = float(np.abs(ours - reference["float32"])[valid].max()) / scale
        vs_same = float(np.abs(ours - reference[dtype])[valid].max()) / scale
        agree = float((ours.argmax(-1) == reference["float32"].argmax(-1))[valid].mean())
        ok = vs_f32 < limit and vs_same < limit
        rows.append([family, dtype, vs_f32, vs_same, agree, limit, "ok" if ok else "OVER"])
    return rows


def run(ctx: Context) -> None:
    try:
        import torch
        import transformers  # noqa: F401
    except ImportError as err:
        raise Skip(f"no {err.name} here (the GPU image has it)") from None
    # torch and JAX share the GPU in this process: JAX takes memory as it needs it, not 75%
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    import jax

    jax.config.update("jax_default_matmul_precision", "highest")
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    if not ctx.dry_run and not torch.cuda.is_available():
        raise RuntimeError("torch sees no GPU")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    shape = DRY_SHAPE if ctx.dry_run else SHAPE
    data = batch(shape["vocab_size"], 4, 32 if ctx.dry_run else 256)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for family, (config, cls) in families(shape).items():
            rows += compare(family, config, cls, data, device, pathlib.Path(tmp) / family)
            ctx.save(rows=rows)  # what a cut-short run leaves
    columns = ["model", "dtype", "vs HF f32", "vs HF same dtype", "argmax agree", "limit", ""]
    title = f"logits vs transformers (torch {torch.__version__} on {device}), max |Δ| / scale"
    ctx.table(title, columns, rows)
    over = [f"{r[0]} {r[1]}" for r in rows if r[-1] != "ok"]
    if over:
        raise RuntimeError(f"over the limit: {', '.join(over)}")


if __name__ == "__main__":
    main("parity", run)
