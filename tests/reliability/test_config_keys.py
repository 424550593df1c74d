"""Every key of the trainer's base config is read by the code that runs (not only by the
config check): a key that exists but that nothing reads would be accepted and ignored.

The run records every read of the config (attribute or item access, `items()`, `to_dict()` of a
section) made outside `hybridjax/config/checks.py` while the trainer is built, trains one
step, validates, saves and restores, then compares the keys read with `base_config()`. A key
read only in another mode (say `reward_model.model.path`, read when a reward model is enabled)
counts when its full dotted name appears in the library outside the config and its check."""

from __future__ import annotations

import os
import sys
import types

import pytest
from ml_collections import ConfigDict

from hybridjax.config.schema import base_config
from hybridjax.rl.trainer import RLTrainer
from tests.rl.tiny_run import gsm8k_subset, tiny_config

pytestmark = pytest.mark.slow

# Keys wired elsewhere; each names its key only.
NOT_READ_HERE = {
    "reward_model.reward_manager",
    "trainer.project_name",
    "trainer.experiment_name",
    # a choice with one valid value (the built-in engine), enforced by the config check
    "actor_rollout_ref.rollout.name",
}
FREE_FORM = ("override_config", "reward_kwargs")  # dict-valued keys, read as a whole
VALIDATE = os.path.join("hybridjax", "trainer", "validate.py")
LIBRARY = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(__file__))), "hybridjax")


def _paths(cfg: ConfigDict, prefix: str = "") -> list[str]:
    out = []
    for key, value in cfg.items():
        if isinstance(value, ConfigDict) and key not in FREE_FORM:
            out += _paths(value, f"{prefix}{key}.")
        else:
            out.append(prefix + key)
    return out


class _Recorder:
    """Patches ConfigDict so reads of `cfg`'s nodes are recorded as dotted key paths."""

    def __init__(self, cfg: ConfigDict, monkeypatch):
        self.read: set[str] = set()
        self.node_path: dict[int, str] = {}
        self._index(cfg, "")
        get, items, to_dict = ConfigDict.__getitem__, ConfigDict.items, ConfigDict.to_dict
        recorder = self

        def __getitem__(node, key):
            recorder._record(node, [key])
            return get(node, key)

        def items_(node, *args, **kw):
            recorder._record(node, list(node.keys()), deep=True)
            return items(node, *args, **kw)

        def to_dict_(node, *args, **kw):
            recorder._record(node, list(node.keys()), deep=True)
            return to_dict(node, *args, **kw)

        monkeypatch.setattr(ConfigDict, "__getitem__", __getitem__)
        monkeypatch.setattr(ConfigDict, "items", items_)
        monkeypatch.setattr(ConfigDict, "to_dict", to_dict_)

    def _index(self, node: ConfigDict, prefix: str) -> None:
        self.node_path[id(node)] = prefix
        for key in node.keys():
            value = ConfigDict.__getitem__(node, key)
            if isinstance(value, ConfigDict):
                self._index(value, f"{prefix}{key}.")

    def _record(self, node, keys, deep=False) -> None:
        prefix = self.node_path.get(id(node))
        if prefix is None:
            return
        frame: types.FrameType | None = sys._getframe(2)
        while frame is not None:  # reads made by the config check do not count
            if frame.f_code.co_filename.endswith(VALIDATE):
                return
            frame = frame.f_back
        for key in keys:
            self.read.add(prefix + key)
            if deep:  # a whole section handed on (to_dict/items): all its keys are read
                self.read.update(p for p in self._all() if p.startswith(f"{prefix}{key}."))

    def _all(self):
        return _paths(base_config())


def _named_in_code(key: str) -> bool:
    """`key` spelled out (`cfg.reward_model.model.path`) in a library file other than the
    config schema and its check."""
    skip = (os.path.join("trainer", "config.py"), VALIDATE)
    for root, _, files in os.walk(LIBRARY):
        for name in files:
            path = os.path.join(root, name)
            if name.endswith(".py") and not path.endswith(skip):
                with open(path, encoding="utf-8") as f:
                    if f".{key}" in f.read():
                        return True
    return False


def test_every_base_config_key_is_read(tmp_path, monkeypatch):
    data = gsm8k_subset(tmp_path / "data", train_rows=16, test_rows=4)
    cfg = tiny_config(
        data,
        tmp_path / "run",
        **{
            "trainer.total_training_steps": -1,  # total_epochs × 1 batch per epoch
            "trainer.test_freq": 1,
            "trainer.val_before_train": True,
            "data.max_response_length": 4,
            "actor_rollout_ref.rollout.response_length": 4,
        },
    )
    recorder = _Recorder(cfg, monkeypatch)
    trainer = RLTrainer(cfg)
    trainer.fit()
    trainer.restore()
    trainer.close()
    keys = set(_paths(base_config()))
    unread = sorted(
        k for k in keys - recorder.read if k not in NOT_READ_HERE and not _named_in_code(k)
    )
    assert not unread, f"base-config keys that no code reads: {unread}"
