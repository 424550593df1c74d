"""Start-up checks of the rollout engine's sizes, and warnings for sampling choices that leave
a run nothing to learn from: each one line naming the key, its value and the valid range.

Problems (`rollout_problems`, errors of `hybridjax.config.checks.validate`):
  * `rollout.page_size` above prompt_length + response_length (a page holds one sequence's
    tokens; a bigger one only wastes the pool);
  * `rollout.num_pages` set (> 0) below what one group of the longest prompt needs (the
    engine would refuse every request): its n samples' pages plus the admission watermark,
    computed by the engine's own page book (`hybridjax.rollout.pages.PageBook`).
Warnings (`rollout_warnings`, `eos_warnings`):
  * greedy sampling (temperature 0, do_sample False or top_k 1) with n > 1 under a
    group-relative advantage estimator: the n samples of a prompt are identical, so every
    advantage is 0;
  * a temperature above 0 but below `MIN_TEMPERATURE`: greedy in effect, and the trainer's
    log-probs at it overflow (1e-30: every update non-finite, skipped);
  * an `eos_token_id` outside the actor's vocabulary (never sampled): every response runs to
    response_length.
"""

from __future__ import annotations

from collections.abc import Mapping

from ml_collections import ConfigDict

from hybridjax.models.config import ModelConfig
from hybridjax.rollout.config import RolloutConfig, SamplingParams
from hybridjax.rollout.pages import PageBook

KEY = "actor_rollout_ref.rollout"
# estimators whose advantage is a sample's score against its group's (0 when all are equal)
GROUP_ESTIMATORS = ("grpo", "rloo", "reinforce_plus_plus_baseline")
MIN_TEMPERATURE = 1e-3  # below it sampling is greedy in effect; 1e-30 gave non-finite updates


def rollout_problems(c: ConfigDict) -> list[str]:
    """Problems of `actor_rollout_ref.rollout`'s page sizes (see the module docstring)."""
    r = c.actor_rollout_ref.rollout
    longest = r.prompt_length + r.response_length
    if r.page_size > longest:
        return [
            f"{KEY}.page_size: must be in [1, prompt_length + response_length = {longest}] "
            f"(got {r.page_size}): a page holds tokens of one sequence"
        ]
    if r.num_pages <= 0:  # sized from memory
        return []
    try:
        config = RolloutConfig.from_config(r)
        n = max(r.n, r.val_kwargs.n)
        params = SamplingParams(n=n, max_tokens=r.response_length)
    except ValueError:  # another key is out of range: reported by its own check
        return []
    book = PageBook(config, r.num_pages)
    need = book.group_pages(r.prompt_length, params) + book.watermark
    if r.num_pages >= need:
        return []
    return [
        f"{KEY}.num_pages: must be -1 (sized from memory) or >= {need} (one group of n={n} "
        f"samples of a {r.prompt_length}-token prompt and {r.response_length}-token responses "
        f"in {r.page_size}-token pages, with the watermark) (got {r.num_pages})"
    ]


def rollout_warnings(c: ConfigDict) -> list[str]:
    """Sampling choices that leave every advantage zero (see the module docstring)."""
    r, estimator = c.actor_rollout_ref.rollout, c.algorithm.adv_estimator
    warnings = []
    if 0 < r.temperature < MIN_TEMPERATURE:
        warnings.append(
            f"{KEY}.temperature={r.temperature} is near 0: sampling is greedy in effect, and "
            "log-probs at that temperature (logits / temperature) can overflow float32, making "
            f"updates non-finite (skipped); use temperature >= {MIN_TEMPERATURE} (or 0 for "
            "greedy)"
        )
    whys = [("temperature=0", r.temperature == 0), ("do_sample=False", not r.do_sample),
            ("top_k=1", r.top_k == 1)]  # fmt: skip
    why = next((w for w, greedy in whys if greedy), None)
    if why and r.n > 1 and estimator in GROUP_ESTIMATORS:
        warnings.append(
            f"{KEY}.{why} with rollout.n={r.n}: the {r.n} samples of a prompt are identical, so "
            f"algorithm.adv_estimator={estimator!r} gives every advantage 0 and the actor does "
            "not learn; set rollout.temperature > 0 (and do_sample=True, top_k != 1) or "
            "rollout.n=1"
        )
    return warnings


def eos_warnings(c: ConfigDict, models: Mapping[str, ModelConfig]) -> list[str]:
    """An actor `eos_token_id` outside its vocabulary (never sampled), unless `ignore_eos`."""
    actor = models.get("actor_rollout_ref.model")
    if actor is None or actor.eos_token_id is None or c.actor_rollout_ref.rollout.ignore_eos:
        return []
    ids = actor.eos_token_id if isinstance(actor.eos_token_id, tuple) else (actor.eos_token_id,)
    outside = [i for i in ids if not 0 <= i < actor.vocab_size]
    if not outside:
        return []
    return [
        f"actor_rollout_ref.model: eos_token_id {outside[0] if len(outside) == 1 else outside} "
        f"is outside the vocabulary (vocab_size {actor.vocab_size}), so no response ends "
        "before rollout.response_length; fix the tokenizer's or the model's eos_token_id "
        "(model.override_config.eos_token_id)"
    ]
