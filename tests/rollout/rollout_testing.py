"""Helpers of the rollout tests: a tiny Qwen2-shaped model with peaked logits, and the
references the engine is checked against (a naive greedy loop over the full forward, the
trainer-side log-probs)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from hybridjax.models.config import ModelConfig
from hybridjax.models.decoder import CausalLM
from hybridjax.rollout.sampling import sample_tokens

TINY = ModelConfig(
    vocab_size=97,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    attention_bias=True,
)
PROMPT_LENGTHS = (5, 9, 1, 4, 12, 7)


@functools.cache
def make_model(config: ModelConfig = TINY, seed: int = 0) -> CausalLM:
    """Normal(0, 0.2) matrices and biases from numpy (no compile), unit norms: logits spread
    ~1 apart, so float32 rounding never flips an argmax between two correct implementations.
    Cached, so tests share it (they never change it)."""
    graphdef, abstract = nnx.split(nnx.eval_shape(lambda: CausalLM(config, nnx.Rngs(seed))))
    rng = np.random.default_rng(seed)

    def fill(x):
        if x.ndim == 1:
            return jnp.ones(x.shape, x.dtype)
        return jnp.asarray(0.2 * rng.standard_normal(x.shape), x.dtype)

    return nnx.merge(graphdef, jax.tree.map(fill, abstract))


def make_prompts(lengths=PROMPT_LENGTHS, seed: int = 1) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(1, TINY.vocab_size, size=n).tolist() for n in lengths]


@functools.cache
def _jitted_forward(graphdef):
    return jax.jit(lambda state, ids, mask: nnx.merge(graphdef, state)(ids, mask))


def full_logits(model: CausalLM, seq, pad_to: int = 64) -> jax.Array:
    """The full forward's logits (len(seq)×V) of one sequence, right-padded to a fixed length
    so that one compile serves every call."""
    graphdef, state = nnx.split(model)
    ids = np.zeros((1, pad_to), np.int32)
    ids[0, : len(seq)] = seq
    mask = np.arange(pad_to)[None] < len(seq)
    return _jitted_forward(graphdef)(state, ids, mask)[0, : len(seq)]


def naive_greedy(model: CausalLM, prompt, max_tokens: int, eos=()) -> list[int]:
    """Argmax of the full forward's last logits, appended one token at a time."""
    seq = list(prompt)
    for _ in range(max_tokens):
        seq.append(int(jnp.argmax(full_logits(model, seq)[-1])))
        if seq[-1] in eos:
            break
    return seq[len(prompt) :]


def trainer_log_probs(model: CausalLM, prompt, response, temperature: float) -> np.ndarray:
    """log_softmax(logits / T) of the response tokens from one full forward (the trainer)."""
    logits = full_logits(model, list(prompt) + list(response))[len(prompt) - 1 : -1]
    lp = jax.nn.log_softmax(logits / temperature, axis=-1)
    return np.asarray(jnp.take_along_axis(lp, jnp.asarray(response)[:, None], axis=-1)[:, 0])


_sample = jax.jit(sample_tokens, static_argnames="use_filter")


def naive_sample(model: CausalLM, prompt, params, index: int, sample: int):
    """(tokens, log-probs) of sample `sample` of prompt `index` without slots or pages: the full
    forward's last logits at each step, token k drawn with the uniform of
    fold_in(fold_in(fold_in(key(seed), index), sample), k) (the engine's documented stream)."""
    key = jax.random.fold_in(jax.random.PRNGKey(params.seed & 0x7FFFFFFF), index)
    key = jax.random.fold_in(key, sample)
    seq, log_probs = list(prompt), []
    for k in range(params.max_tokens):
        u = jax.random.uniform(jax.random.fold_in(key, k), dtype=jnp.float32)
        token, lp, _ = _sample(
            full_logits(model, seq)[-1:],
            u[None],
            jnp.array([params.temperature], jnp.float32),
            jnp.array([params.top_k]),
            jnp.array([params.top_p], jnp.float32),
            params.uses_filter,
        )
        seq.append(int(token[0]))
        log_probs.append(float(lp[0]))
    return seq[len(prompt) :], log_probs
