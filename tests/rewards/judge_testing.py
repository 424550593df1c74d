"""A tiny judge whose verdicts are known: a 1-layer decoder whose attention and MLP write zero,
so each next token depends only on the current one, through its class:

  * a response ending in `!` → verdict `9`;  ending in `?` → verdict `x` (unparseable);
  * any other last token → verdict `2`;       after a digit or `x` → end of sequence.

Embeddings are one-hot class vectors and `lm_head` maps each class to its next token, so greedy
decoding (any template whose judge prompt ends with the response) writes one verdict token and
stops. It uses the shipped GSM8K tokenizer (the actor's in the tiny config)."""

import functools
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import hybridjax
from hybridjax.models.config import ModelConfig
from hybridjax.models.decoder import CausalLM
from hybridjax.models.hf_io import save_pretrained
from hybridjax.models.tokenizer import Tokenizer

TOKENIZER = os.path.join(os.path.dirname(hybridjax.__file__), "assets", "tokenizers", "gsm8k_bpe")
TEMPLATE = "Judge: {prompt} | {response}"  # ends with the response's last token


@functools.cache
def tokenizer() -> Tokenizer:
    return Tokenizer.from_pretrained(TOKENIZER)


def expected_verdict(response: str) -> str:
    """The text the judge writes after a judge prompt ending in `response`."""
    last = tokenizer().decode(tokenizer().encode(response)[-1:])
    return {"!": "9", "?": "x"}.get(last, "2")


@functools.cache
def make_judge() -> CausalLM:
    tok = tokenizer()
    eos = tok.eos_token_id
    vocab = tok.backend.get_vocab()
    ids = lambda text: vocab[text]
    config = ModelConfig(
        vocab_size=tok.vocab_size,
        hidden_size=8,
        intermediate_size=8,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        attention_bias=True,  # Qwen2's (saved as zeros)
        eos_token_id=eos,
    )
    graphdef, abstract = nnx.split(nnx.eval_shape(lambda: CausalLM(config, nnx.Rngs(0))))
    classes = np.zeros(tok.vocab_size, np.int64)  # 0: any other token
    classes[[ids(str(d)) for d in range(10)] + [ids("x")]] = 1
    classes[ids("!")], classes[ids("?")] = 2, 3
    embed = np.eye(8, dtype=np.float32)[classes]
    head = np.zeros((8, tok.vocab_size), np.float32)
    for cls, nxt in enumerate((ids("2"), eos, ids("9"), ids("x"))):
        head[cls, nxt] = 10.0

    def fill(path, x):
        name = jax.tree_util.keystr(path)
        if "embed_tokens" in name:
            return jnp.asarray(embed)
        if "lm_head" in name:
            return jnp.asarray(head)
        return jnp.ones(x.shape, x.dtype) if x.ndim == 1 else jnp.zeros(x.shape, x.dtype)

    return nnx.merge(graphdef, jax.tree_util.tree_map_with_path(fill, abstract))


def save_judge(path: str) -> str:
    """Writes the judge checkpoint and its tokenizer to `path` (returned)."""
    save_pretrained(make_judge(), path)
    for name in os.listdir(TOKENIZER):
        shutil.copy(os.path.join(TOKENIZER, name), path)
    return path
