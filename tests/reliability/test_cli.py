"""Bad inputs and faults through the command line (see `experiments/reliability/probe.py`).

Config mistakes are judged before any model is built, so they run batched: one subprocess
runs the command line's body (`hybridjax.train.run` under `cli_errors`) once per case and
reports each exit code and message. Checkpoint, export and signal cases run the real command
line, one subprocess each, against one tiny trained run shared by the session (slow). Each case
must end `clear` (exit code 2, a message naming key/file/row, no traceback) or `documented`."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from experiments.reliability import probe

UPFRONT = {  # case: (overrides, words the message must hold)
    "reward_on_error": ({"reward_model.on_error": "ignore"}, ["reward_model.on_error", "'zero'"]),
    "model_dtype": ({"actor_rollout_ref.model.dtype": "float17"}, ["model.dtype", "'bfloat16'"]),
    "attention_impl": ({"actor_rollout_ref.rollout.attention_impl": "flash"}, ["'jnp'"]),
    "rollout_name": ({"actor_rollout_ref.rollout.name": "vllm"}, ["rollout.name", "'hybridjax'"]),
    "resume_latest": ({"trainer.resume_mode": "latest"}, ["'latest'", "'auto', 'disable'"]),
    "resume_missing": ({"trainer.resume_mode": "{tmp}/no/global_step_9"}, ["global_step_9"]),
    "local_dir_file": ({"trainer.default_local_dir": "{tmp}/a_file"}, ["default_local_dir"]),
    "train_file_dir": ({"data.train_files": "{tmp}"}, ["is a directory"]),
    "reward_missing": ({"custom_reward_function.path": "{tmp}/nope.py"}, ["nope.py"]),
    "reward_signature": (
        {"custom_reward_function.path": "{tmp}/sig.py"},
        ["sig.py", "signature (text)"],
    ),
    "model_config_json": (
        {"actor_rollout_ref.model.path": "{tmp}/model"},
        ["{tmp}/model/config.json", "line 2, column"],
    ),
}

DRIVER = """
import contextlib, io, json, sys
from hybridjax.errors import cli_errors
from hybridjax.train import run
from tests.rl.tiny_run import load_config_file
results = {}
for name, overrides in json.loads(sys.argv[1]).items():
    cfg = load_config_file("tiny")
    cfg.data.train_files = "hybridjax/assets/quickstart/data/train.parquet"
    cfg.data.val_files = "hybridjax/assets/quickstart/data/test.parquet"
    cfg.update_from_flattened_dict(overrides)
    err = io.StringIO()
    code = 0
    try:
        with contextlib.redirect_stderr(err), cli_errors("hybridjax.train"):
            run(cfg)
    except SystemExit as e:
        code = e.code
    except BaseException as e:  # a bug: it would have printed a traceback
        code, err = -1, io.StringIO(f"Traceback (most recent call last): {e!r}")
    results[name] = (code, err.getvalue())
print("RESULTS" + json.dumps(results))
"""


def test_config_mistakes_stop_before_any_model_with_one_message(tmp_path):
    (tmp_path / "a_file").write_text("notes\n")
    (tmp_path / "sig.py").write_text("def compute_score(text):\n    return 1.0\n")
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text('{"hidden_size": 8,\n "x": ,}')
    (tmp_path / "data.parquet").write_bytes(b"")
    cases = {
        name: {k: str(v).replace("{tmp}", str(tmp_path)) for k, v in overrides.items()}
        for name, (overrides, _) in UPFRONT.items()
    }
    proc = subprocess.run(
        [sys.executable, "-c", DRIVER, json.dumps(cases)],
        cwd=probe.REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    line = [x for x in proc.stdout.splitlines() if x.startswith("RESULTS")]
    assert line, proc.stdout[-2000:] + proc.stderr[-3000:]
    results = json.loads(line[0].removeprefix("RESULTS"))
    for name, (_, needles) in UPFRONT.items():
        code, message = results[name]
        assert code == 2, (name, code, message)
        assert "Traceback" not in message, (name, message)
        for needle in needles:
            assert needle.replace("{tmp}", str(tmp_path)) in message, (name, needle, message)
    assert not (tmp_path / "no").exists()  # a missing resume path is not created
    assert (tmp_path / "a_file").read_text() == "notes\n"
    assert probe.BUILT not in proc.stderr  # no model was built for any of them


@pytest.fixture(scope="session")
def ctx(tmp_path_factory):
    return probe.prepare(tmp_path_factory.mktemp("probe"), str(probe.REPO))


CLI_CASES = [
    "invalid_utf8_row",
    "ground_truth_list",
    "special_tokens_error",
    "special_tokens_counted",
    "truncation_counted",
    "resume_config_mismatch",
    "export_config_mismatch",
    "resume_corrupt_newest",
    "export_corrupt_newest",
    "export_into_occupied_dir",
    "export_overwrite",
    "sft_output_dir_occupied",
    "sft_malformed_jsonl",
    "second_sigint",
    "disk_full",
]


@pytest.mark.slow
@pytest.mark.parametrize("name", CLI_CASES)
def test_case(ctx, name):
    category, detail = probe.CASES[name](ctx)
    if category == "skipped":
        pytest.skip(detail)
    assert category in ("clear", "documented"), f"{name}: {category}: {detail}"
