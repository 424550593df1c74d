"""TRL `GRPOTrainer` on a peer-comparison workload (torch CPU, float32).

Run with the TRL virtualenv made by `experiments/peers/setup_venvs.sh`:

  OMP_NUM_THREADS=1 experiments/peers/.venvs/trl/bin/python experiments/peers/run_trl.py \
      --workload=a --out=/tmp/trl_a.json

Writes JSON: step times (s, from the reward-call clock in `reward.py`), prompt+response tokens
per step, mean scores, the settings used and the library versions.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys
import tempfile

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

from reward import StepClock  # noqa: E402
from workload import load  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=None, help="timed steps (after warm-up)")
    parser.add_argument("--threads", type=int, default=int(os.environ.get("OMP_NUM_THREADS", 1)))
    args = parser.parse_args()

    import torch
    import transformers
    import trl
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(args.threads)
    spec = load(args.workload)
    steps = (args.steps or spec["steps"]) + spec["warmup"] + 1
    tokenizer = AutoTokenizer.from_pretrained(spec["model_dir"])
    model = AutoModelForCausalLM.from_pretrained(spec["model_dir"], dtype=torch.float32)
    prompts = [p["prompt"] for p in spec["prompts"]]
    truth = {p["prompt"]: p["ground_truth"] for p in spec["prompts"]}

    def count_tokens(prompts, completions, completion_ids=None, **_):
        prompt_tokens = sum(len(tokenizer.encode(p)) for p in prompts)
        return prompt_tokens + sum(len(c) for c in completion_ids)

    clock = StepClock(truth, count_tokens)
    batch = spec["num_prompts"] * spec["n"]
    generation_kwargs = {}
    if spec["fixed_response_length"]:
        generation_kwargs["min_new_tokens"] = spec["response_length"]
    config = trl.GRPOConfig(
        output_dir=tempfile.mkdtemp(prefix="trl_grpo_"),
        use_cpu=True,
        bf16=False,
        fp16=False,
        per_device_train_batch_size=batch,
        gradient_accumulation_steps=1,
        num_generations=spec["n"],
        max_completion_length=spec["response_length"],
        temperature=spec["temperature"],
        top_p=spec["top_p"],
        top_k=spec["top_k"] or 0,
        generation_kwargs=generation_kwargs or None,
        learning_rate=spec["learning_rate"],
        beta=spec["beta"],
        epsilon=spec["epsilon"],
        num_iterations=1,
        # TRL's GRPO defaults to activation recomputation; the other systems keep activations.
        gradient_checkpointing=False,
        max_steps=steps,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        seed=spec["seed"],
        dataloader_num_workers=0,
        disable_tqdm=True,
    )
    dataset = Dataset.from_dict({"prompt": prompts * steps})
    trainer = trl.GRPOTrainer(
        model=model,
        reward_funcs=clock,
        args=config,
        train_dataset=dataset,
        processing_class=tokenizer,
    )
    trainer.train()
    result = {
        "system": "trl",
        "workload": args.workload,
        "threads": args.threads,
        "versions": {
            "trl": trl.__version__,
            "torch": torch.__version__,
            "transformers": transformers.__version__,
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
