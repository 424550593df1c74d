"""HF export: refuses an occupied target, replaces only an earlier export with `overwrite`, never
a run directory, its parents, checkpoints or a live run's files, and a crash in the middle
leaves the old export (and nothing else) in place."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest
from flax import nnx

from configs.sft_arithmetic import TOKENIZER
from hybridjax.checkpointing.export import MANIFEST, check_export_target, write_hf_export
from hybridjax.errors import ExportError
from hybridjax.models.config import ModelConfig
from hybridjax.models.decoder import CausalLM
from hybridjax.models.hf_io import load_pretrained
from hybridjax.models.tokenizer import Tokenizer

REPO = pathlib.Path(__file__).resolve().parents[2]
EXPORT = [MANIFEST, "config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"]


@pytest.fixture(scope="module")
def model_and_tokenizer():
    tokenizer = Tokenizer.from_pretrained(TOKENIZER)
    config = ModelConfig(
        vocab_size=tokenizer.vocab_size,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        attention_bias=True,  # Qwen2's q/k/v biases
        tie_word_embeddings=True,
    )
    return CausalLM(config, nnx.Rngs(0)), tokenizer


def _files(path) -> dict[str, bytes]:
    return {n: (path / n).read_bytes() for n in sorted(os.listdir(path))}


def _occupied(tmp_path):
    target = tmp_path / "hf"
    target.mkdir()
    (target / "model_backup_v1.safetensors").write_bytes(b"precious")
    (target / "model-00001-of-00002.safetensors").write_bytes(b"shard")
    (target / "model.safetensors.index.json").write_text("{}")
    return target


def test_export_into_a_new_directory(tmp_path, model_and_tokenizer):
    write_hf_export(*model_and_tokenizer, str(tmp_path / "a" / "hf"))
    assert sorted(os.listdir(tmp_path / "a" / "hf")) == EXPORT
    assert sorted(os.listdir(tmp_path / "a")) == ["hf"]  # no temporary directory left
    load_pretrained(tmp_path / "a" / "hf")


def test_occupied_target_is_refused_untouched(tmp_path, model_and_tokenizer):
    target = _occupied(tmp_path)
    before = _files(target)
    with pytest.raises(ExportError, match=r"not empty \(model-00001.*--overwrite"):
        write_hf_export(*model_and_tokenizer, str(target))
    assert _files(target) == before
    assert sorted(os.listdir(tmp_path)) == ["hf"]
    (tmp_path / "file").write_text("x")
    with pytest.raises(ExportError, match="not a directory"):
        write_hf_export(*model_and_tokenizer, str(tmp_path / "file"))


def test_overwrite_replaces_an_earlier_export(tmp_path, model_and_tokenizer):
    target = tmp_path / "hf"
    write_hf_export(*model_and_tokenizer, str(target))
    (target / "config.json").write_text("{}")  # an export's own file, changed: still its own
    write_hf_export(*model_and_tokenizer, str(target), overwrite=True)
    assert sorted(os.listdir(target)) == EXPORT
    assert (target / "config.json").read_text() != "{}"
    assert sorted(os.listdir(tmp_path)) == ["hf"]


def test_overwrite_removes_nothing_outside_the_export(tmp_path, model_and_tokenizer):
    """A manifest naming files outside its directory (edited, or crafted) removes none."""
    target = tmp_path / "hf"
    write_hf_export(*model_and_tokenizer, str(target))
    (tmp_path / "keep.txt").write_text("mine")
    manifest = target / MANIFEST
    files = json.loads(manifest.read_text())["files"]
    manifest.write_text(json.dumps({"files": [*files, "../keep.txt", str(tmp_path / "keep.txt")]}))
    write_hf_export(*model_and_tokenizer, str(target), overwrite=True)
    assert (tmp_path / "keep.txt").read_text() == "mine"
    assert sorted(os.listdir(target)) == EXPORT


def _refused(target, match, **kw) -> None:
    """`check_export_target` refuses `target` in one line naming it and `match`."""
    with pytest.raises(ExportError) as err:
        check_export_target(str(target), overwrite=True, **kw)
    message = str(err.value)
    assert "\n" not in message and str(target) in message, message
    assert match in message, message


def test_overwrite_refuses_files_it_did_not_write_and_leaves_them(tmp_path, model_and_tokenizer):
    target = _occupied(tmp_path)
    before = _files(target)
    with pytest.raises(ExportError, match=f"{target} was not written by an export"):
        write_hf_export(*model_and_tokenizer, str(target), overwrite=True)
    assert _files(target) == before
    write_hf_export(*model_and_tokenizer, str(tmp_path / "hf2"))
    (tmp_path / "hf2" / "notes.txt").write_text("mine")  # an export plus a file of the user
    _refused(tmp_path / "hf2", "files the export did not write (notes.txt)")
    (tmp_path / "hf2" / "notes.txt").unlink()
    (tmp_path / "hf2" / "adapter").mkdir()
    (tmp_path / "hf2" / "adapter" / "x.bin").write_bytes(b"")  # deeper too
    _refused(tmp_path / "hf2", "did not write (adapter/x.bin)")


def test_overwrite_through_a_link_replaces_the_export_it_names(tmp_path, model_and_tokenizer):
    """A target that is a symbolic link to an earlier export: that export is replaced, the
    link kept, and nothing is left beside them."""
    write_hf_export(*model_and_tokenizer, str(tmp_path / "hf"))
    (tmp_path / "hf" / "config.json").write_text("{}")
    (tmp_path / "latest").symlink_to(tmp_path / "hf")
    write_hf_export(*model_and_tokenizer, str(tmp_path / "latest"), overwrite=True)
    assert (tmp_path / "latest").is_symlink()
    assert sorted(os.listdir(tmp_path / "hf")) == EXPORT
    assert (tmp_path / "hf" / "config.json").read_text() != "{}"
    assert sorted(n for n in os.listdir(tmp_path) if not n.endswith(".lock")) == ["hf", "latest"]


def test_overwrite_refuses_a_link_to_a_directory_it_did_not_write(tmp_path, model_and_tokenizer):
    write_hf_export(*model_and_tokenizer, str(tmp_path / "hf"))
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "a.txt").write_text("mine")
    (tmp_path / "hf" / "data").symlink_to(tmp_path / "mine")
    _refused(tmp_path / "hf", "did not write (data)")
    assert (tmp_path / "hf" / "data" / "a.txt").read_text() == "mine"


def test_overwrite_refuses_runs_checkpoints_and_their_parents(tmp_path):
    run = tmp_path / "runs" / "run"
    step = run / "global_step_2"
    (step / "state").mkdir(parents=True)
    (run / "logs").mkdir()
    _refused(run, "is the run's directory", protected=[str(run)])
    _refused(tmp_path / "runs", "holds the run directory", protected=[str(run)])
    _refused(tmp_path, "holds the run directory", protected=[str(run)])
    _refused(step, "inside the checkpoint directory")
    _refused(step / "state", "inside the checkpoint directory")
    _refused(tmp_path / "runs", "holds checkpoints (run/global_step_2)")  # any run, known or not
    (tmp_path / "runs" / ".run.lock").write_text("")
    _refused(tmp_path / "runs", "holds a run's lock file (.run.lock)")
    assert step.is_dir() and (run / "logs").is_dir()
    check_export_target(str(run / "hf"), overwrite=True, protected=[str(run)])  # sft's default


def test_refusals_stay_on_one_line_whatever_the_file_names(tmp_path, model_and_tokenizer):
    write_hf_export(*model_and_tokenizer, str(tmp_path / "hf"))
    (tmp_path / "hf" / "a\nb").write_text("mine")  # a newline in a name
    (tmp_path / "hf" / os.fsdecode(b"bad\xff")).write_text("mine")  # bytes that are not text
    _refused(tmp_path / "hf", "did not write ('a\\nb', 'bad\\udcff')")


def test_overwrite_refuses_the_models_the_run_reads(tmp_path, model_and_tokenizer):
    """An earlier export that a run starts from (its model.path) is not replaced: a resumed
    run reads it again (the reference policy, LoRA's base). Nor is a parent of it."""
    sft = tmp_path / "exports" / "sft"
    write_hf_export(*model_and_tokenizer, str(sft))
    inputs = {"actor_rollout_ref.model.path": str(sft)}
    _refused(sft, "is actor_rollout_ref.model.path, a model the run reads", inputs=inputs)
    _refused(tmp_path / "exports", "holds the model of actor_rollout_ref.model.path", inputs=inputs)
    before = _files(sft)
    with pytest.raises(ExportError, match="a model the run reads"):
        write_hf_export(*model_and_tokenizer, str(sft), overwrite=True, inputs=inputs)
    assert _files(sft) == before
    check_export_target(str(tmp_path / "exports" / "rl"), overwrite=True, inputs=inputs)


def test_a_checkpoint_is_known_by_its_metadata_under_any_name(tmp_path):
    """A checkpoint reached by another name (a bind mount, a copy renamed) is still one."""
    ckpt = tmp_path / "mnt" / "step"
    (ckpt / "state").mkdir(parents=True)
    (ckpt / "_CHECKPOINT_METADATA").write_text("{}")
    _refused(ckpt / "hf", "is inside the checkpoint directory")
    _refused(ckpt / "state", "is inside the checkpoint directory")
    check_export_target(str(tmp_path / "mnt" / "hf"), overwrite=True)


HOLDER = """
import sys, time
from hybridjax.checkpointing.run_lock import hold
lock = hold(sys.argv[1], "trainer.default_local_dir")
print("held", flush=True)
sys.stdin.readline()  # the test's export happens here
with open(sys.argv[1] + "/global_step_1.txt", "w") as f:  # the run's next save
    f.write("saved")
print("saved", flush=True)
"""


def test_export_to_the_parent_of_a_live_run_is_refused_and_the_run_goes_on(tmp_path):
    """A run (a process holding its directory, as `hybridjax.train` does) under `parent`; an
    export with --overwrite to `parent` through the command line is refused in one line, before
    any model is built, and the run saves its next step."""
    parent, run = tmp_path / "parent", tmp_path / "parent" / "run"
    run.mkdir(parents=True)
    (run / "global_step_0.txt").write_text("saved")
    env = dict(os.environ, PYTHONPATH=str(REPO), JAX_PLATFORMS="cpu")
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(run)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=env,
        cwd=REPO,
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        export = subprocess.run(
            [
                sys.executable,
                "-m",
                "hybridjax.train",
                "--config=configs/tiny.py",
                f"--config.trainer.default_local_dir={tmp_path / 'other_run'}",
                f"--export_hf={parent}",
                "--overwrite",
            ],
            capture_output=True,
            text=True,
            env=env,
            cwd=REPO,
            timeout=300,
        )
        holder.stdin.write("go\n")
        holder.stdin.flush()
        assert holder.stdout.readline().strip() == "saved"
    finally:
        holder.stdin.close()
        holder.wait(timeout=30)
    assert export.returncode == 2, export.stderr
    lines = export.stderr.strip().splitlines()
    assert lines[-1].startswith(f"hybridjax.train: error: export target {parent} holds a run")
    assert "Traceback" not in export.stderr
    assert holder.returncode == 0
    assert sorted(os.listdir(run)) == ["global_step_0.txt", "global_step_1.txt"]
    assert not (tmp_path / ".parent.lock").exists()  # a refused target gets no lock file beside


def test_a_crash_while_writing_leaves_the_old_export(tmp_path, model_and_tokenizer, monkeypatch):
    model, tokenizer = model_and_tokenizer
    target = tmp_path / "hf"
    write_hf_export(model, tokenizer, str(target))
    before = _files(target)

    def crash(path):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(tokenizer, "save", crash)
    with pytest.raises(OSError, match="No space"):
        write_hf_export(model, tokenizer, str(target), overwrite=True)
    assert _files(target) == before
    assert sorted(os.listdir(tmp_path)) == ["hf"]  # the partial export was removed


def test_a_mount_point_is_refused_and_a_busy_target_is_one_line(
    tmp_path, model_and_tokenizer, monkeypatch
):
    """An earlier export that is a mount point cannot be moved aside (EBUSY): it was a
    traceback, with an empty `.hf.replaced-*` left beside it (issue 48's third probe, X26)."""
    model, tokenizer = model_and_tokenizer
    target = tmp_path / "hf"
    write_hf_export(model, tokenizer, str(target))
    before = _files(target)
    real_ismount = os.path.ismount
    monkeypatch.setattr(os.path, "ismount", lambda p: str(p) == str(target) or real_ismount(p))
    with pytest.raises(ExportError, match=r"hf is a mount point: .* inside it$"):
        write_hf_export(model, tokenizer, str(target), overwrite=True)
    monkeypatch.setattr(os.path, "ismount", real_ismount)
    real_replace = os.replace

    def busy(src, dst):
        if str(src) == str(target):
            raise OSError(16, "Device or resource busy")
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", busy)
    with pytest.raises(
        ExportError,
        match=r"cannot replace export target .*hf: Device or resource busy; it is unchanged$",
    ):
        write_hf_export(model, tokenizer, str(target), overwrite=True)
    assert _files(target) == before
    assert sorted(os.listdir(tmp_path)) == ["hf"]  # nothing left beside it
