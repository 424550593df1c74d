"""The quiet console: INFO goes to the run's log file, the console shows warnings unless
`--verbosity` asks for more."""

import logging

import pytest
from absl import flags
from absl import logging as absl_logging

from hybridjax.metrics.console import announce, configure_logging, console_level


@pytest.fixture
def restore_logging():
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    for handler in root.handlers:
        if handler not in handlers:
            root.removeHandler(handler)
            handler.close()
    for handler in handlers:
        if handler not in root.handlers:
            root.addHandler(handler)
    root.setLevel(level)


def test_info_goes_to_the_file_not_the_console(tmp_path, capsys, restore_logging):
    log_file = tmp_path / "logs" / "train.log"
    configure_logging(str(log_file), logging.WARNING)
    logging.getLogger("hybridjax.rollout.engine").info("compiling decode (1 compiles so far)")
    absl_logging.info("orbax saved step 3")
    logging.getLogger("hybridjax.rewards").warning("reward function failed on row 2")
    err = capsys.readouterr().err
    assert "reward function failed on row 2" in err
    assert "compiling" not in err and "orbax" not in err
    text = log_file.read_text()
    assert "INFO hybridjax.rollout.engine: compiling decode" in text
    assert "orbax saved step 3" in text and "row 2" in text


def test_verbosity_brings_info_back_once(tmp_path, capsys, restore_logging):
    configure_logging(str(tmp_path / "a.log"), logging.WARNING)
    configure_logging(str(tmp_path / "b.log"), logging.INFO)  # --verbosity=0; replaces the first
    logging.getLogger("hybridjax.rl").info("resumed from step 4")
    assert capsys.readouterr().err.count("resumed from step 4") == 1
    assert "resumed" in (tmp_path / "b.log").read_text()
    assert not (tmp_path / "a.log").exists()  # created at its first record only


def test_events_that_change_the_run_show_on_the_quiet_console(tmp_path, capsys, restore_logging):
    configure_logging(str(tmp_path / "train.log"), logging.WARNING)
    announce(logging.getLogger("hybridjax.trainer"), "resumed from step 4 of /runs/a")
    logging.getLogger("hybridjax.trainer").info("compiled")
    err = capsys.readouterr().err
    assert "NOTICE hybridjax.trainer: resumed from step 4 of /runs/a" in err
    assert "compiled" not in err and "resumed from step 4" in (tmp_path / "train.log").read_text()


def test_console_level_follows_verbosity_only_when_given(monkeypatch):
    flag = flags.FLAGS["verbosity"]
    monkeypatch.setattr(flag, "present", 0)
    monkeypatch.setattr(flag, "value", 0)  # absl's app.run default: INFO, not asked for
    assert console_level() == logging.WARNING
    monkeypatch.setattr(flag, "present", 1)  # --verbosity=0
    assert console_level() == logging.INFO
    monkeypatch.setattr(flag, "value", 1)  # --verbosity=1
    assert console_level() == logging.DEBUG
