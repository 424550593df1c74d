"""Every notebook runs top to bottom (shortened with HYBRIDJAX_NOTEBOOK_STEPS=2), as a user
would run it, and prints what it promises. Slow: each is a short training run."""

import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# notebook -> texts its outputs must contain
EXPECTED = {
    "quickstart.ipynb": ("parameters", "timing_s/gen", "trained to step 2"),
    "gsm8k_grpo.ipynb": (
        "reward_model",
        "input_ids",
        "val-core/openai/gsm8k/acc/maj@4/mean",
        "timing_s/update_actor",
        "'key': 'val/generations'",
    ),
    "sft.ipynb": ("train/loss", "model.safetensors", "ground truth:"),
    "dpo.ipynb": ("'chosen'", "eval_rewards/accuracies", "adapter_model.safetensors"),
    "multi_turn.ipynb": ("unknown tool 'search'", "[tool]", "multi_turn/num_turns_mean"),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_notebook_executes(name, monkeypatch):
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    notebook = nbformat.read(os.path.join(ROOT, "notebooks", name), as_version=4)
    monkeypatch.setenv("HYBRIDJAX_NOTEBOOK_STEPS", "2")
    client = nbclient.NotebookClient(
        notebook,
        timeout=600,
        kernel_name="python3",
        resources={"metadata": {"path": os.path.join(ROOT, "notebooks")}},
    )
    client.execute()
    text = "\n".join(
        str(o.get("text", "")) + str(o.get("data", {}).get("text/plain", ""))
        for cell in notebook.cells
        for o in cell.get("outputs", [])
    )
    for expected in EXPECTED[name]:
        assert expected in text, (expected, text[-3000:])
    images = [
        o for c in notebook.cells for o in c.get("outputs", []) if "image/png" in o.get("data", {})
    ]
    assert images, "no figure drawn"
