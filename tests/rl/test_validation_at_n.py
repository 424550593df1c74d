"""Validation at N > 1 samples on the quick-start task, checked against the logged samples;
logged generations; `fit()` after `train_step(1)` continues at step 2."""

import collections
import json

import numpy as np
import pytest

from hybridjax.rewards import default_compute_score
from hybridjax.rl.evaluation import ANSWER_EXTRACTORS, prompt_texts
from hybridjax.rl.trainer import RLTrainer
from tests.metrics.test_validation_metrics import _verl_bootstrap, _verl_maj
from tests.rl.tiny_run import load_config_file

N, PROMPTS = 4, 8


@pytest.mark.slow
def test_validation_at_n_samples_and_logged_generations(tmp_path):
    c = load_config_file("quickstart")
    c.data.val_max_samples = PROMPTS
    c.data.val_batch_size = PROMPTS
    c.actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu = 16  # 8 test devices
    c.actor_rollout_ref.rollout.val_kwargs.update(n=N, temperature=1.0, do_sample=True)
    c.trainer.update(
        default_local_dir=str(tmp_path),
        total_training_steps=2,
        test_freq=2,
        val_before_train=False,
        log_val_generations=N * PROMPTS,  # every sample, to check the metrics against
        log_train_generations=3,
        progress_bar=False,
        logger=("jsonl",),
    )
    trainer = RLTrainer(c)
    manager, scored = trainer.reward.manager, []
    submit = manager.submit

    def recording_submit(responses, sources, truths, *args):
        future = submit(responses, sources, truths, *args)
        scored.append((responses, truths, future.result().scores))
        return future

    manager.submit = recording_submit
    metrics = trainer.validate()
    manager.submit = submit
    samples = metrics.pop("val/generations")
    assert len(samples) == N * PROMPTS

    ((responses, truths, scores),) = scored  # one batch: rows prompt-major, N per prompt
    extract = ANSWER_EXTRACTORS["arithmetic"]
    expected = collections.defaultdict(list)
    for p in range(PROMPTS):
        rows = range(p * N, (p + 1) * N)
        values = [float(scores[i]) for i in rows]
        for i in rows:  # the rule, by hand: 1 for "#### <truth>", else 0
            assert values[i - p * N] == default_compute_score("arithmetic", responses[i], truths[i])
        expected["mean@4"].append(np.mean(values))
        expected["std@4"].append(np.std(values))
        [(best, _)] = _verl_bootstrap(values, N, [np.max])
        expected["best@4/mean"].append(best)
        votes = [{"val": float(scores[i]), "pred": extract(responses[i])} for i in rows]
        [(maj, _)] = _verl_bootstrap(votes, N, [_verl_maj])
        expected["maj@4/mean"].append(maj)
    core = "val-core/arithmetic/acc"
    assert metrics[f"{core}/mean@4"] == pytest.approx(np.mean(expected["mean@4"]))
    assert metrics["val-aux/arithmetic/acc/std@4"] == pytest.approx(np.mean(expected["std@4"]))
    assert metrics[f"{core}/best@4/mean"] == pytest.approx(np.mean(expected["best@4/mean"]))
    assert metrics[f"{core}/maj@4/mean"] == pytest.approx(np.mean(expected["maj@4/mean"]))
    assert metrics[f"{core}/best@4/mean"] >= metrics[f"{core}/mean@4"]
    # at temperature 1 the warm start answers in both forms, so samples disagree
    assert 0 < metrics[f"{core}/mean@4"] < 1

    # the logged samples are the scored rows (prompt decoded, response, score)
    batch = next(trainer.val_loader.iter_epoch())
    texts = prompt_texts(trainer.tokenizer, batch["input_ids"], batch["attention_mask"])
    rows = {(texts[i // N], responses[i], float(scores[i])) for i in range(N * PROMPTS)}
    assert set(samples) == rows

    first = trainer.train_step(1)
    assert len(first["train/generations"]) == 3
    last = trainer.fit()  # continues at step 2, not step 1 again
    trainer.close()
    records = [
        json.loads(x) for x in (tmp_path / "logs" / "metrics.jsonl").read_text().splitlines()
    ]
    assert [r["step"] for r in records] == [2]
    assert f"{core}/maj@4/mean" in last
    generations = [
        json.loads(x) for x in (tmp_path / "logs" / "generations.jsonl").read_text().splitlines()
    ]
    assert collections.Counter((g["step"], g["key"]) for g in generations) == {
        (2, "train/generations"): 3,
        (2, "val/generations"): N * PROMPTS,
    }
