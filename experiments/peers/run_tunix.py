"""Tunix `GRPOLearner` (vanilla rollout, JAX CPU, float32) on a peer-comparison workload.

Run with the Tunix virtualenv made by `experiments/peers/setup_venvs.sh`:

  experiments/peers/.venvs/tunix/bin/python experiments/peers/run_tunix.py \
      --workload=a --out=/tmp/tunix_a.json

Writes JSON: step times (s, from the reward-call clock in `reward.py`), prompt+response tokens
per step, mean scores, the settings used and the library versions.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import pathlib
import sys
import tempfile

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

from reward import StepClock  # noqa: E402
from workload import load  # noqa: E402


def _qwen2_config(model_dir: str):
    from tunix.models.qwen2 import model as qwen2

    hf = json.loads((pathlib.Path(model_dir) / "config.json").read_text())
    rope = hf.get("rope_theta") or (hf.get("rope_parameters") or {}).get("rope_theta", 10000.0)
    return qwen2.ModelConfig(
        num_layers=hf["num_hidden_layers"],
        vocab_size=hf["vocab_size"],
        embed_dim=hf["hidden_size"],
        hidden_dim=hf["intermediate_size"],
        num_heads=hf["num_attention_heads"],
        head_dim=hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"],
        num_kv_heads=hf["num_key_value_heads"],
        rope_theta=int(rope),
        norm_eps=hf["rms_norm_eps"],
        use_tied_embedding=hf["tie_word_embeddings"],
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=None, help="timed steps (after warm-up)")
    args = parser.parse_args()

    import grain
    import jax
    import numpy as np
    import optax
    from transformers import AutoTokenizer
    from tunix.models.qwen2 import params as qwen2_params
    from tunix.rl import rl_cluster as rl_cluster_lib
    from tunix.rl.grpo import grpo_learner
    from tunix.rl.rollout import base_rollout

    spec = load(args.workload)
    steps = (args.steps or spec["steps"]) + spec["warmup"] + 1
    tokenizer = AutoTokenizer.from_pretrained(spec["model_dir"])
    # A plain Mesh (Auto axes): Tunix's models expect automatic sharding propagation.
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("fsdp", "tp"))
    with mesh:
        actor = qwen2_params.create_model_from_safe_tensors(
            spec["model_dir"], _qwen2_config(spec["model_dir"]), mesh
        )
    prompts = [p["prompt"] for p in spec["prompts"]]
    truth = {p["prompt"]: p["ground_truth"] for p in spec["prompts"]}

    def count_tokens(prompts, completions, **_):
        # Tunix hands the reward only text: re-encoding random-model text can split it into
        # more tokens than were sampled, so a response counts at most response_length tokens.
        cap = spec["response_length"]
        prompt_tokens = sum(len(tokenizer.encode(p)) for p in prompts)
        return prompt_tokens + sum(min(len(tokenizer.encode(c)), cap) for c in completions)

    clock = StepClock(truth, count_tokens)
    batch = spec["num_prompts"]
    rollout_config = base_rollout.RolloutConfig(
        max_tokens_to_generate=spec["response_length"],
        max_prompt_length=spec["max_prompt_length"],
        kv_cache_size=spec["max_prompt_length"] + spec["response_length"] + 8,
        temperature=spec["temperature"],
        top_p=spec["top_p"],
        top_k=spec["top_k"],
        # A fixed response length: stop on no token (-1 is never sampled).
        eos_tokens=[-1] if spec["fixed_response_length"] else None,
    )
    cluster_config = rl_cluster_lib.ClusterConfig(
        role_to_mesh={
            rl_cluster_lib.Role.ACTOR: mesh,
            rl_cluster_lib.Role.REFERENCE: mesh,
            rl_cluster_lib.Role.ROLLOUT: mesh,
        },
        rollout_engine="vanilla",
        offload_to_cpu=False,
        training_config=rl_cluster_lib.RLTrainingConfig(
            actor_optimizer=optax.adamw(spec["learning_rate"]),
            eval_every_n_steps=10_000,
            max_steps=steps,
            mini_batch_size=batch,
            train_micro_batch_size=batch,
            rollout_micro_batch_size=batch,
            compute_logps_micro_batch_size=batch,
            checkpoint_root_directory=tempfile.mkdtemp(prefix="tunix_grpo_"),
        ),
        rollout_config=rollout_config,
    )
    cluster = rl_cluster_lib.RLCluster(
        actor=actor, reference=None, tokenizer=tokenizer, cluster_config=cluster_config
    )
    learner = grpo_learner.GRPOLearner(
        rl_cluster=cluster,
        algo_config=grpo_learner.GRPOConfig(
            num_generations=spec["n"],
            num_iterations=1,
            beta=spec["beta"],
            epsilon=spec["epsilon"],
        ),
        reward_fns=[clock],
    )
    dataset = grain.MapDataset.source([{"prompts": p} for p in prompts * steps]).batch(batch)
    with mesh:
        learner.train(dataset)
    result = {
        "system": "tunix",
        "workload": args.workload,
        "versions": {
            "google-tunix": importlib.metadata.version("google-tunix"),
            "jax": jax.__version__,
        },
        "warmup": spec["warmup"],
        "step_times_s": clock.step_times_s(),
        "step_cpu_times_s": clock.step_cpu_times_s(),
        "tokens_per_step": clock.tokens[1:],
        "score_mean": clock.scores,
    }
    pathlib.Path(args.out).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
