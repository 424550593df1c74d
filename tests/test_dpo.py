"""DPO: losses and metrics on worked values (the papers' formulas), against TRL's `DPOTrainer`
loss code on the same log-probs, config checks, and the arithmetic example learning (slow)."""

import collections
import json
import math
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hybridjax.offline.dpo import DPOConfig, dpo_metrics, pair_losses
from tests.child_env import child_env

# Two pairs: sequence log-probs (policy, reference) of chosen and rejected, response lengths.
PC, PR = np.array([-2.0, -5.0], np.float32), np.array([-4.0, -3.0], np.float32)
RC, RR = np.array([-3.0, -4.0], np.float32), np.array([-3.5, -3.5], np.float32)
LC, LR = np.array([2.0, 4.0], np.float32), np.array([3.0, 1.0], np.float32)
# log-ratios: chosen (1, −1), rejected (−0.5, 0.5) → Δ = (1.5, −1.5)


def _losses(loss_type, beta=0.1, eps=0.0):
    cfg = DPOConfig(beta=beta, loss_type=loss_type, label_smoothing=eps)
    return [np.asarray(x) for x in pair_losses(PC, PR, RC, RR, LC, LR, cfg)]


def _log_sigmoid(x):
    return -math.log1p(math.exp(-x))


def test_sigmoid_and_cdpo_worked_values():
    loss, chosen, rejected = _losses("sigmoid")
    np.testing.assert_allclose(loss, [-_log_sigmoid(0.15), -_log_sigmoid(-0.15)], rtol=1e-6)
    np.testing.assert_allclose(chosen, [0.1, -0.1], rtol=1e-6)
    np.testing.assert_allclose(rejected, [-0.05, 0.05], rtol=1e-6)
    loss, _, _ = _losses("sigmoid", beta=0.5, eps=0.2)  # cDPO (Mitchell 2023)
    expected = [-0.8 * _log_sigmoid(d) - 0.2 * _log_sigmoid(-d) for d in (0.75, -0.75)]
    np.testing.assert_allclose(loss, expected, rtol=1e-6)


def test_ipo_and_hinge_worked_values():
    loss, _, _ = _losses("ipo", beta=0.25)  # (1/2 − (−0.5)/3 − 2)², (−1/4 − 0.5 − 2)²
    np.testing.assert_allclose(loss, [(0.5 + 0.5 / 3 - 2) ** 2, (-0.25 - 0.5 - 2) ** 2], rtol=1e-6)
    loss, _, _ = _losses("hinge", beta=0.5)  # max(0, 1 − 0.75), max(0, 1 + 0.75)
    np.testing.assert_allclose(loss, [0.25, 1.75], rtol=1e-6)


def test_metrics_worked_values():
    loss, chosen, rejected = _losses("sigmoid")
    m = {k: float(v) for k, v in dpo_metrics(loss, chosen, rejected, PC, PR).items()}
    assert m["rewards/chosen"] == pytest.approx(0.0, abs=1e-7)
    assert m["rewards/rejected"] == pytest.approx(0.0, abs=1e-7)
    assert m["rewards/accuracies"] == 0.5  # pair 0 only: 0.1 > −0.05
    assert m["rewards/margins"] == pytest.approx(0.0, abs=1e-7)  # (0.15 − 0.15) / 2
    assert m["logps/chosen"] == -3.5 and m["logps/rejected"] == -3.5
    assert m["loss"] == pytest.approx(float(loss.mean()))


def test_bad_config_is_named():
    with pytest.raises(ValueError, match="dpo.loss_type 'kto'.*sigmoid"):
        DPOConfig(loss_type="kto")
    with pytest.raises(ValueError, match="label_smoothing.*sigmoid"):
        DPOConfig(loss_type="ipo", label_smoothing=0.1)


def _trl_loss(loss_type, beta, completion_mask):
    """TRL's `DPOTrainer._compute_loss` on our log-probs: a stand-in model returns per-token
    log-probs whose sums over the completion are PC / PR; the reference log-probs are passed
    precomputed, as TRL's `precompute_ref_log_probs` does."""
    torch = pytest.importorskip("torch")
    trl = pytest.importorskip("trl")
    b, t = completion_mask.shape
    mask = torch.tensor(completion_mask, dtype=torch.float32)
    per_token = torch.zeros(b, t - 1)
    logps = torch.tensor(np.concatenate([PC, PR]))
    for row in range(b):
        first = int(mask[row, 1:].nonzero()[0])
        per_token[row, first] = logps[row]  # the sequence's log-prob on its first token
    outputs = types.SimpleNamespace(
        log_probs=per_token,
        is_top1=torch.zeros(b, t - 1, dtype=torch.bool),
        entropy=torch.zeros(b, t - 1),
        mean_logits=torch.zeros(b, t - 1),
    )
    accelerator = types.SimpleNamespace(device="cpu", gather=lambda x: x)
    accelerator.gather_for_metrics = lambda x: x
    trainer = types.SimpleNamespace(
        model=types.SimpleNamespace(training=True),
        accelerator=accelerator,
        aux_loss_enabled=False,
        use_weighting=False,
        ld_alpha=None,
        precompute_ref_logps=True,
        f_divergence_type="reverse_kl",
        loss_types=[loss_type],
        loss_weights=[1.0],
        beta=beta,
        label_smoothing=0.0,
        _metrics={"train": collections.defaultdict(list)},
        _total_train_tokens=0,
        _tp_size=1,
    )
    inputs = {
        "input_ids": torch.ones(b, t, dtype=torch.long),
        "attention_mask": torch.ones(b, t, dtype=torch.long),
        "completion_mask": mask.long(),
        "ref_chosen_logps": torch.tensor(RC),
        "ref_rejected_logps": torch.tensor(RR),
    }
    loss = trl.DPOTrainer._compute_loss(trainer, lambda **kw: outputs, inputs, False)
    return float(loss), {k: v[0] for k, v in trainer._metrics["train"].items()}


@pytest.mark.parametrize("loss_type,beta", [("sigmoid", 0.1), ("ipo", 0.25), ("hinge", 0.5)])
def test_matches_trl_dpo_trainer(loss_type, beta):
    # rows [chosen 0, chosen 1, rejected 0, rejected 1]; completions of LC / LR tokens
    lengths = np.concatenate([LC, LR]).astype(int)
    mask = np.zeros((4, 8), np.int64)
    for row, n in enumerate(lengths):
        mask[row, 8 - n :] = 1
    theirs, metrics = _trl_loss(loss_type, beta, mask)
    cfg = DPOConfig(beta=beta, loss_type=loss_type)
    ours = dpo_metrics(*pair_losses(PC, PR, RC, RR, LC, LR, cfg), jnp.asarray(PC), PR)
    assert float(ours["loss"]) == pytest.approx(theirs, rel=1e-5)
    for key in ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins"):
        assert float(ours[key]) == pytest.approx(metrics[key], rel=1e-5, abs=1e-7), key
    for key in ("logps/chosen", "logps/rejected"):
        assert float(ours[key]) == pytest.approx(metrics[key], rel=1e-5), key


@pytest.mark.slow
def test_arithmetic_example_raises_preference_and_greedy_accuracy(tmp_path):
    """The README's example command (shortened to 32 steps), one CPU device as a user runs it."""
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = child_env(as_user=True, PYTHONPATH=root)  # `experiments` is not installed; one CPU device
    args = ["-m", "experiments.examples.dpo_arithmetic", "--steps", "32", "--results", "r"]
    proc = subprocess.run(
        [sys.executable, *args], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=1500
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (path,) = (tmp_path / "r").glob("*/dpo_arithmetic.json")
    summary = json.loads(path.read_text())
    before, after = summary["held_out"]["0"], summary["held_out"]["32"]
    assert after["eval_logps/accuracies"] >= before["eval_logps/accuracies"] + 0.2, summary
    assert after["eval_rewards/accuracies"] >= 0.8, summary
    assert after["eval_loss"] < 0.6, summary
    greedy = summary["greedy_accuracy"]
    assert greedy["after"] >= greedy["before"] + 0.15, summary


def _write_preferences(path, n):
    with open(path, "w") as f:
        for i in range(n):
            a, b = i % 10, (3 * i) % 10
            prompt = [{"role": "user", "content": f"He has {a} cups and gets {b} more."}]
            chosen = [{"role": "assistant", "content": f"#### {a + b}"}]  # TRL's message form
            f.write(json.dumps({"prompt": prompt, "chosen": chosen, "rejected": f"#### {a}"}))
            f.write("\n")


def _dpo_config(tmp_path, steps, **changes):
    from configs.sft_arithmetic import TOKENIZER
    from hybridjax.offline.dpo import dpo_config
    from tests.quickstart.test_sft import TINY

    c = dpo_config()
    c.data.train_files = c.data.val_files = str(tmp_path / "pairs.jsonl")
    c.data.tokenizer = TOKENIZER
    c.data.max_length = 32
    c.data.train_batch_size = 8
    c.model.override_config = TINY
    c.model.lora_rank = 4
    c.dpo.beta = 1.0
    c.optim.lr = 1e-2
    c.trainer.total_training_steps = steps
    c.trainer.default_local_dir = str(tmp_path / "run")
    c.trainer.logger = ("jsonl",)
    c.update_from_flattened_dict(changes)
    return c


@pytest.mark.slow
def test_lora_dpo_learns_resumes_exactly_and_exports(tmp_path):
    from flax import nnx

    from hybridjax.models.hf_io import load_pretrained
    from hybridjax.offline.dpo import run_dpo

    _write_preferences(tmp_path / "pairs.jsonl", 32)
    straight = run_dpo(_dpo_config(tmp_path, 8, **{"trainer.val_before_train": True}))
    records = [json.loads(line) for line in open(tmp_path / "run" / "logs" / "metrics.jsonl")]
    assert records[0]["step"] == 0 and records[0]["eval_loss"] == pytest.approx(math.log(2))
    assert straight["eval_loss"] < records[0]["eval_loss"] - 0.02
    assert straight["eval_rewards/accuracies"] > 0.5
    assert {"loss", "learning_rate", "grad_norm", "rewards/margins"} <= set(records[1])
    assert (tmp_path / "run" / "hf" / "adapter" / "adapter_model.safetensors").is_file()
    a = load_pretrained(tmp_path / "run" / "hf")

    cut = tmp_path / "cut"
    cut.mkdir()
    _write_preferences(cut / "pairs.jsonl", 32)
    run_dpo(_dpo_config(cut, 4, **{"trainer.save_freq": 2}))
    resumed = run_dpo(_dpo_config(cut, 8, **{"trainer.save_freq": 2}), overwrite=True)  # step 4
    assert resumed["eval_loss"] == straight["eval_loss"]
    b = load_pretrained(cut / "run" / "hf")
    for x, y in zip(jax.tree.leaves(nnx.state(a)), jax.tree.leaves(nnx.state(b)), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
