"""SFT warm start of the calculator-tool demonstration: the quick start's warm start fine-tuned
on arithmetic word problems whose teacher sometimes calls a calculator on the hard ones (see
`hybridjax.data.arithmetic_tools`).

    python -m hybridjax.data.arithmetic_tools --output data/arithmetic_tools
    python -m hybridjax.sft --config=configs/sft_arithmetic_tools.py

(the demonstration runs it twice: 500 steps on a teacher that always calls, `--tool_p 1
--sloppy_p 0`, then the default 60 steps on the default teacher from that model; see
`configs/arithmetic_tools.py`.)
The responses are multi-turn trajectories (assistant call, tool response, assistant answer),
laid out as the multi-turn rollout builds them; the loss covers the assistant turns only.
Starts from `hybridjax/assets/quickstart/sft_model` (which already computes the easy problems),
with `max_position_embeddings` raised to 256 (a trajectory with a failed call is up to 146
tokens; RoPE has no learned positions). `experiments/examples/tool_arithmetic.py` runs this,
then `configs/arithmetic_tools.py` (GRPO with the calculator), and measures both.
"""

import os

import hybridjax
from hybridjax.offline.sft import sft_config

QUICKSTART = os.path.join(os.path.dirname(hybridjax.__file__), "assets", "quickstart")


def get_config():
    c = sft_config()
    c.data.train_files = "data/arithmetic_tools/sft.parquet"
    c.data.max_length = 160
    c.data.train_batch_size = 64
    c.model.path = os.path.join(QUICKSTART, "sft_model")
    c.model.override_config = dict(max_position_embeddings=256)
    c.optim.lr = 5e-4
    c.optim.lr_warmup_steps = 10
    c.optim.warmup_style = "cosine"
    c.optim.min_lr_ratio = 0.1
    c.trainer.experiment_name = "sft_arithmetic_tools"
    c.trainer.total_training_steps = 60
    c.trainer.resume_mode = "disable"
    return c
