"""The forward+backward cost benchmark: input construction (fast) and a run at test size (slow)."""

import json

import numpy as np
import pytest

from experiments.benchmarks import update_cost


def test_inputs_are_left_padded_prompts_and_right_padded_responses():
    x = update_cost.make_inputs(rows=3, prompt_len=8, response_len=8)
    # Row r: (7r mod 2) prompt pads, (5r mod 2) response pads.
    np.testing.assert_array_equal(x["attention_mask"][1], [0] + [1] * 14 + [0])
    np.testing.assert_array_equal(x["position_ids"][1], [0] + list(range(14)) + [13])
    np.testing.assert_array_equal(x["responses"], x["input_ids"][:, 8:])
    np.testing.assert_array_equal(x["response_mask"][2], [1.0] * 8)


@pytest.mark.slow
def test_tiny_run_times_both_systems_on_the_same_loss(tmp_path):
    update_cost.main(["--workloads", "tiny", "--repeats", "1", "--out", str(tmp_path)])
    summary = json.loads((tmp_path / "update_cost.json").read_text())
    (tiny,) = summary["workloads"]
    assert tiny["hybridjax"]["cpu_s"] > 0 and tiny["torch"]["cpu_s"] > 0
    assert tiny["loss_abs_diff"] < 1e-5
