"""The quick start with DAPO's dynamic sampling and a user stage, and no trainer edits.

    python -m hybridjax.train --config=configs/quickstart_dapo.py

How it differs from `configs/quickstart.py` (GRPO):
  * dynamic sampling (`algorithm.filter_groups`, DAPO §3.2): a prompt whose 8 responses all get
    the same score carries no GRPO signal; its group is dropped and further batches of prompts
    are generated until 16 groups are kept (at most 4 batches per step);
  * a user stage from `configs/stages/banned_filter.py` runs after `reward` and zeroes the
    score of responses containing a banned string (`timing_s/zero_banned`, `reward/banned`).
"""

import os

from hybridjax.user_code import load_module

HERE = os.path.dirname(os.path.abspath(__file__))


def get_config():
    c = load_module(os.path.join(HERE, "quickstart.py")).get_config()
    c.algorithm.filter_groups.enable = True
    c.algorithm.filter_groups.metric = "score"
    c.algorithm.filter_groups.max_num_gen_batches = 4
    stage_file = os.path.join(HERE, "stages", "banned_filter.py")
    c.trainer.stages = (f"after reward: {stage_file}:zero_banned",)
    c.trainer.experiment_name = "quickstart_dapo"
    c.trainer.default_local_dir = "checkpoints/hybridjax/quickstart_dapo"
    return c
