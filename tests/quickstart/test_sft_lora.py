"""LoRA SFT (`model.lora_rank`): adapters learn, the base stays, the checkpoint holds adapters only,
and the export is the merged model plus a peft adapter."""

import json

import numpy as np
from safetensors import safe_open

from hybridjax.models.hf_io import load_pretrained
from hybridjax.offline.sft import run_sft
from tests.quickstart.test_sft import _config, _write_pairs


def test_lora_sft_learns_and_exports_merged_and_adapter(tmp_path):
    _write_pairs(tmp_path / "train.jsonl", 64)
    c = _config(tmp_path, 12)
    c.model.lora_rank = 8
    c.model.lora_alpha = 16.0
    c.optim.lr = 1e-2
    run_sft(c)
    records = [json.loads(line) for line in open(tmp_path / "run" / "logs" / "metrics.jsonl")]
    assert records[-1]["train/loss"] < 0.95 * records[0]["train/loss"]  # frozen random base
    saved = {p.name for p in (tmp_path / "run").rglob("*") if "global_step" in str(p)}
    assert not any("embed_tokens" in n or "layernorm" in n for n in saved), "base checkpointed"
    hf = tmp_path / "run" / "hf"
    merged = load_pretrained(hf)
    with open(hf / "adapter" / "adapter_config.json") as f:
        adapter = json.load(f)
    assert (
        adapter["r"] == 8 and adapter["lora_alpha"] == 16.0 and len(adapter["target_modules"]) == 7
    )
    with safe_open(str(hf / "adapter" / "adapter_model.safetensors"), "np") as f:
        names = list(f.keys())
        b = f.get_tensor("base_model.model.model.layers.0.mlp.down_proj.lora_B.weight")
    assert len(names) == 2 * 7 * merged.config.num_hidden_layers
    assert np.abs(b).max() > 0  # the adapters moved from their zero start
