"""`trainer.project_name` / `trainer.experiment_name` name the run's directory (verl's
`checkpoints/${project_name}/${experiment_name}`) unless `default_local_dir` is given, also
when set on the command line."""

import os
import subprocess
import sys

from tests.rl.tiny_run import REPO, load_config_file

SCRIPT = """
import sys
from absl import app
from hybridjax import train
app.run(lambda _: print(train._CONFIG.value.trainer.default_local_dir), argv=sys.argv)
"""


def test_experiment_name_names_the_run_directory():
    assert load_config_file("quickstart").trainer.default_local_dir == (
        "checkpoints/hybridjax/quickstart"
    )
    c = load_config_file("tiny")
    c.update_from_flattened_dict({"trainer.experiment_name": "x"})
    assert c.trainer.default_local_dir == "checkpoints/hybridjax/x"
    c.update_from_flattened_dict({"trainer.default_local_dir": "/tmp/r"})
    assert (c.trainer.default_local_dir, c.trainer.experiment_name) == ("/tmp/r", "x")
    # the command line (absl config flags) follows the same references
    named = ("--config.trainer.experiment_name=lr3e-5", "--config.trainer.project_name=arith")
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT, *named],
        env=dict(os.environ, PYTHONPATH=str(REPO)),
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "checkpoints/arith/lr3e-5"
