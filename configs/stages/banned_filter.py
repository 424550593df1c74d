"""A user stage: zero the score of every response that contains a banned string.

It runs after `reward` (it reads `token_level_scores`) and before `adv`, so a banned response
counts as a wrong answer in its group's statistics. No trainer code changes; select it with

    --config.trainer.stages="('after reward: configs/stages/banned_filter.py:zero_banned',)"

or from Python: `default_pipeline(cfg).insert_after("reward", zero_banned)`. Its wall time is
logged as `timing_s/zero_banned`, and the share of responses it zeroed as `reward/banned`.
"""

import jax.numpy as jnp
import numpy as np

from hybridjax.rewards import decode_responses
from hybridjax.rl import stage

BANNED = ("sorry", "I cannot")


@stage(reads=("responses", "response_mask", "token_level_scores"), writes=("token_level_scores",))
def zero_banned(batch, ctx):
    """token_level_scores × 0 on responses containing one of `BANNED` (host sync: decodes)."""
    texts = decode_responses(ctx.deps.tokenizer, ctx.host.responses, ctx.host.response_mask)
    banned_B = np.array([any(word in text for word in BANNED) for text in texts])
    ctx.metrics["reward/banned"] = float(banned_B.mean())
    keep_Bx1 = jnp.asarray(~banned_B, jnp.float32)[:, None]
    return batch.replace(token_level_scores=batch.token_level_scores * keep_Bx1)
