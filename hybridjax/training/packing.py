"""Which training-side passes run packed (`hybridjax.models.packing`), from the config.

Per role, verl's keys: `<model>.use_remove_padding` turns packing on (default on), the token
budget of a micro-batch per device is `*_max_token_len_per_gpu` with `use_dynamic_bsz`, else
the padded micro-batch's tokens (micro-batch rows per device × (P + R)), and
`use_prefix_sharing` (default on) lets the responses of a prompt share one copy of it.

The passes and their keys are listed in `_sources`: old_log_prob and update_actor read the
actor's keys (old_log_prob's budget and rows are `rollout.log_prob_*`), ref reads `ref.*`,
values and update_critic `critic.*` (values' rows: `rollout.log_prob_micro_batch_size_per_gpu`,
as the padded path), the reward model `reward_model.*`.
"""

from __future__ import annotations

from ml_collections import ConfigDict

from hybridjax.metrics.flops import matmul_params
from hybridjax.models.config import ModelConfig
from hybridjax.models.packing import PackingConfig

PASSES = ("old_log_prob", "update_actor", "ref", "values", "update_critic", "reward_model")


def _sources(cfg: ConfigDict) -> dict[str, tuple]:
    """pass → (remove_padding key, dynamic key, budget key, rows key, sharing key), dotted."""
    a, r, c, m = "actor_rollout_ref.actor", "actor_rollout_ref.rollout", "critic", "reward_model"
    model, ref = "actor_rollout_ref.model", "actor_rollout_ref.ref"
    return {
        "old_log_prob": (
            f"{model}.use_remove_padding",
            f"{r}.log_prob_use_dynamic_bsz",
            f"{r}.log_prob_max_token_len_per_gpu",
            f"{r}.log_prob_micro_batch_size_per_gpu",
            f"{a}.use_prefix_sharing",
        ),
        "update_actor": (
            f"{model}.use_remove_padding",
            f"{a}.use_dynamic_bsz",
            f"{a}.ppo_max_token_len_per_gpu",
            f"{a}.ppo_micro_batch_size_per_gpu",
            f"{a}.use_prefix_sharing",
        ),
        "ref": (
            f"{model}.use_remove_padding",
            f"{ref}.log_prob_use_dynamic_bsz",
            f"{ref}.log_prob_max_token_len_per_gpu",
            f"{ref}.log_prob_micro_batch_size_per_gpu",
            f"{ref}.use_prefix_sharing",
        ),
        "values": (
            f"{c}.model.use_remove_padding",
            f"{c}.use_dynamic_bsz",
            f"{c}.forward_max_token_len_per_gpu",
            f"{r}.log_prob_micro_batch_size_per_gpu",
            f"{c}.use_prefix_sharing",
        ),
        "update_critic": (
            f"{c}.model.use_remove_padding",
            f"{c}.use_dynamic_bsz",
            f"{c}.ppo_max_token_len_per_gpu",
            f"{c}.ppo_micro_batch_size_per_gpu",
            f"{c}.use_prefix_sharing",
        ),
        "reward_model": (
            f"{m}.model.use_remove_padding",
            f"{m}.use_dynamic_bsz",
            f"{m}.forward_max_token_len_per_gpu",
            f"{m}.micro_batch_size_per_gpu",
            f"{m}.use_prefix_sharing",
        ),
    }


def _get(cfg: ConfigDict, key: str):
    for part in key.split("."):
        cfg = cfg[part]
    return cfg


def packing_problems(cfg: ConfigDict) -> list[str]:
    """Config problems of the packing keys: a token budget below one sequence (P + R), or a
    dynamic batch size without packing."""
    total = cfg.data.max_prompt_length + cfg.data.max_response_length
    problems = []
    for remove, dynamic, budget, _, _ in _sources(cfg).values():
        if not _get(cfg, dynamic):
            continue
        if not _get(cfg, remove):
            problems.append(f"{dynamic}: needs {remove} (micro-batches by token count pack)")
        elif _get(cfg, budget) < total:
            problems.append(
                f"{budget}: must hold one sequence, data.max_prompt_length + "
                f"data.max_response_length = {total} tokens (got {_get(cfg, budget)})"
            )
    return problems


def attention_pair_cost(model: ModelConfig) -> float:
    """One query-key pair of attention in units of one token's matmul work, forward and
    backward alike: 12·head_dim·heads·layers FLOPs per pair against 6·N per token
    (`metrics.flops.training_flops`, N = `matmul_params`), so 2·head_dim·heads·layers / N."""
    per_pair = model.resolved_head_dim * model.num_attention_heads * model.num_hidden_layers
    return 2.0 * per_pair / matmul_params(model)


def packing_configs(
    cfg: ConfigDict, data_parallel: int, pair_cost: float = 0.0
) -> dict[str, PackingConfig | None]:
    """pass → its `PackingConfig`, or None where `use_remove_padding` is off (see the table in
    the module docstring). Rows sized by `models.packing.row_responses` with `pair_cost`
    (`attention_pair_cost` of the model; 0: a whole group per row), capped by the budget."""
    p, r = cfg.data.max_prompt_length, cfg.data.max_response_length
    n = cfg.actor_rollout_ref.rollout.n
    out = {}
    for name, (remove, dynamic, budget, rows, share) in _sources(cfg).items():
        if not _get(cfg, remove):
            out[name] = None
            continue
        tokens = _get(cfg, budget) if _get(cfg, dynamic) else _get(cfg, rows) * (p + r)
        out[name] = PackingConfig.for_budget(
            tokens, p, r, n, pair_cost, pieces=data_parallel, share_prompts=bool(_get(cfg, share))
        )
    return out
