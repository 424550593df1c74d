"""Rollout/trainer mismatch on the quick start: how far two computations of the same
log-probs drift apart, and what sampling-mask replay does to the rollout IS ratio.

* `batch_invariance`: the quick start's model scores the same 8 sequences (prompts of the
  quick start's data, responses drawn from the model) once as one batch of 8 and once row by
  row (batch 1), the trainer's pass (`hybridjax.training.forward.model_log_probs`, fused head), in
  float32 and in bfloat16 (parameters and matmuls): verl #6280's measurement. Reported with
  `hybridjax.algorithms.rollout_correction.mismatch_metrics`: the share of tokens whose ratio
  leaves [0.9, 1.1] and the max |Δ log p|.
* `quickstart_ratios`: one GRPO step of the quick start (4 prompts × 8 samples) sampling with
  `top_p` 0.8 or `top_k` 20 in float32, and with `top_p` 0.8 with bfloat16 matmuls and
  generation weights (the engine/trainer mismatch in bfloat16). After `gen`, π_old is
  computed over the replayed support and over the full vocabulary; the mean rollout IS
  ratio π_old / π_rollout of each is reported beside the mean kept probability mass
  (exp(full − replayed)) and the ratio the step itself logged
  (`rollout_corr/token_ratio_mean`, replay on by default).

    python -m experiments.benchmarks.mismatch [--out DIR] [--skip-ratios]

Writes `DIR/mismatch.json` (default `experiments/results/YYYYMMDD_HHMMSS_mismatch/`).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import pathlib
import tempfile

import jax
import jax.numpy as jnp
import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[2]
RATIO = "rollout_corr/token_ratio_mean"
R = "actor_rollout_ref.rollout."
SAMPLINGS = {"top_p_0.8": {R + "top_p": 0.8}, "top_k_20": {R + "top_k": 20}}  # float32
# the same with bfloat16 matmuls in training and bfloat16 generation weights
BF16 = {"actor_rollout_ref.model.dtype": "bfloat16", R + "dtype": "bfloat16"}
RUNS = SAMPLINGS | {"top_p_0.8_bfloat16": SAMPLINGS["top_p_0.8"] | BF16}


def _quickstart_config(run_dir, **changes):
    """The quick start cut to one step of 4 prompts × 8 samples, no validation."""
    from hybridjax.user_code import load_module

    c = load_module(str(ROOT / "configs" / "quickstart.py")).get_config()
    c.data.train_batch_size = 4
    a = c.actor_rollout_ref
    a.actor.ppo_mini_batch_size = 4
    a.actor.ppo_micro_batch_size_per_gpu = 4  # divides 32 responses on up to 8 devices
    a.rollout.log_prob_micro_batch_size_per_gpu = 4
    t = c.trainer
    t.total_training_steps, t.test_freq, t.val_before_train = 1, -1, False
    t.default_local_dir, t.logger, t.progress_bar = str(run_dir), ("jsonl",), False
    c.update_from_flattened_dict(changes)
    return c


def quickstart_ratios(run_dir: pathlib.Path, changes: dict) -> dict:
    """One quick-start step with `changes` (dotted config keys); see the module docstring.
    Returns the mean ratios, the kept mass, the share of truncated tokens and the mismatch."""
    from hybridjax.rl import step as step_module
    from hybridjax.rl.pipeline import Stage
    from hybridjax.rl.trainer import RLTrainer

    config = _quickstart_config(run_dir, **changes)
    seen = {}

    def both_semantics(batch, ctx):
        m = ctx.models
        for replay in (True, False):
            sc = dataclasses.replace(ctx.stage_config, replay_sampling_mask=replay)
            out, metrics = step_module._old_log_prob(
                m.actor_graphdef, m.actor_state.params, batch, sc
            )
            seen[replay] = jax.device_get((out, metrics))
        return batch

    pipeline = step_module.default_pipeline(config).insert_after(
        "gen", Stage("both", both_semantics)
    )
    trainer = RLTrainer(config, pipeline=pipeline)
    replays = trainer.stage_config_of("actor").replay_sampling_mask
    trainer.fit()
    trainer.close()
    (replayed, m_replay), (full, m_full) = seen[True], seen[False]
    mask = np.asarray(replayed.response_mask) > 0
    kept = np.exp(np.asarray(full.old_log_probs) - np.asarray(replayed.old_log_probs))[mask]
    threshold = np.asarray(replayed.rollout_logit_threshold)[mask]
    return {
        "auto_replays": bool(replays),
        "tokens": int(mask.sum()),
        "truncated_token_share": float(np.isfinite(threshold).mean()),
        "kept_mass_mean": float(kept.mean()),
        "kept_mass_max": float(kept.max()),
        "is_ratio_mean_replay": float(m_replay[RATIO]),
        "is_ratio_mean_full_vocab": float(m_full[RATIO]),
        "outside_0.9_1.1_replay": float(m_replay["rollout_corr/token_ratio_outside_frac"]),
        "max_abs_log_prob_diff_replay": float(m_replay["rollout_corr/max_abs_log_prob_diff"]),
        "max_abs_log_prob_diff_full_vocab": float(m_full["rollout_corr/max_abs_log_prob_diff"]),
        "outside_0.9_1.1_full_vocab": float(m_full["rollout_corr/token_ratio_outside_frac"]),
        "is_ratio_mean_logged_by_the_step": _logged(run_dir)[RATIO],
    }


def _logged(run_dir: pathlib.Path) -> dict:
    """Step 1's metrics from the run's JSONL log."""
    lines = (run_dir / "logs" / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["step"] == 1][-1]


def quickstart_prompts(rows: int = 8) -> list[list[int]]:
    """The token ids of the first `rows` prompts of the quick start's test split."""
    import pyarrow.parquet as pq

    from hybridjax.models.tokenizer import Tokenizer

    path = ROOT / "hybridjax" / "assets" / "quickstart"
    tokenizer = Tokenizer.from_pretrained(path / "sft_model")
    table = pq.read_table(path / "data" / "test.parquet").slice(0, rows).to_pylist()
    return [tokenizer.encode(r["prompt"][-1]["content"]) for r in table]


def _sequences(model, rows: int = 8, seed: int = 0):
    """`rows` quick-start prompts and a sampled response each (the engine-free full-forward
    sampler of the tests), as the trainer's padded fields."""
    prompts = quickstart_prompts(rows)
    p, r = max(map(len, prompts)), 16
    key = jax.random.key(seed)
    ids = np.zeros((rows, p + r), np.int32)
    attention = np.zeros((rows, p + r), np.int32)
    for i, prompt in enumerate(prompts):
        ids[i, p - len(prompt) : p] = prompt
        attention[i, p - len(prompt) : p] = 1
    for t in range(r):  # sample each response token from the model, temperature 1
        attention[:, p + t] = 1
        positions = np.maximum(np.cumsum(attention, axis=1) - 1, 0)
        hidden, _ = model.model(jnp.asarray(ids), jnp.asarray(positions), jnp.asarray(attention))
        logits = model.logits(hidden[:, p + t - 1 : p + t])[:, 0]
        key, sub = jax.random.split(key)
        ids[:, p + t] = np.asarray(jax.random.categorical(sub, logits.astype(jnp.float32)))
    positions = np.maximum(np.cumsum(attention, axis=1) - 1, 0)
    return {
        "input_ids": jnp.asarray(ids),
        "attention_mask": jnp.asarray(attention),
        "position_ids": jnp.asarray(positions),
        "responses": jnp.asarray(ids[:, p:]),
        "response_mask": jnp.ones((rows, r), jnp.float32),
    }


def batch_invariance(dtype: str, rows: int = 8, batch_invariant: bool = False) -> dict:
    """The quick start's model scoring the same `rows` sequences at batch `rows` and at batch
    1 in `dtype` (parameters and matmuls), in parity mode with `batch_invariant`
    (`hybridjax.models.invariant`): `mismatch_metrics` of the two, float32 figures."""
    from hybridjax.algorithms.rollout_correction import mismatch_metrics
    from hybridjax.models.hf_io import load_pretrained
    from hybridjax.training.forward import model_log_probs

    path = ROOT / "hybridjax" / "assets" / "quickstart" / "sft_model"
    overrides = {"dtype": dtype, "param_dtype": dtype, "batch_invariant": batch_invariant}
    model = load_pretrained(path, config_overrides=overrides)
    fields = _sequences(load_pretrained(path))  # the same sequences for both dtypes
    score = jax.jit(lambda f: model_log_probs(model, f, 1.0)[0])
    together = score(fields)
    alone = jnp.concatenate(
        [score(jax.tree.map(lambda x: x[i : i + 1], fields)) for i in range(rows)]
    )
    m = mismatch_metrics(together, alone, fields["response_mask"])
    keys = ("token_ratio_outside_frac", "max_abs_log_prob_diff", "token_ratio_mean", "kl")
    out = {k: float(m[f"rollout_corr/{k}"]) for k in keys}
    out["tokens"] = int(fields["response_mask"].sum())
    out["differing_tokens"] = int(jnp.sum(together != alone))
    return out


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None)
    parser.add_argument("--skip-ratios", action="store_true", help="batch invariance only")
    args = parser.parse_args(argv)
    stamp = datetime.datetime.now().strftime("%Y%m%d_%H%M%S")
    out = pathlib.Path(args.out or ROOT / "experiments" / "results" / f"{stamp}_mismatch")
    out.mkdir(parents=True, exist_ok=True)
    summary = {
        "backend": jax.default_backend(),
        "devices": jax.device_count(),
        "batch_1_vs_8": {d: batch_invariance(d) for d in ("float32", "bfloat16")},
    }
    if not args.skip_ratios:
        summary["quickstart_is_ratio"] = {}
        for name, changes in RUNS.items():
            with tempfile.TemporaryDirectory() as tmp:
                summary["quickstart_is_ratio"][name] = quickstart_ratios(pathlib.Path(tmp), changes)
    (out / "mismatch.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(json.dumps(summary, indent=2))
    return summary


if __name__ == "__main__":
    main()
