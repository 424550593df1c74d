"""SFT warm start of the quick start: a 3,423,488-parameter Qwen2-shaped model on arithmetic
word problems answered by a sloppy teacher (see `hybridjax.data.arithmetic`).

    python -m hybridjax.data.arithmetic --output data/arithmetic
    python -m hybridjax.sft --config=configs/sft_arithmetic.py

The warm start is deliberately weak in one way only. The teacher's arithmetic is always right,
but it ends with GSM8K's `#### n` on 90% of the additions and 30% of the subtractions and
multiplications (`Answer: n` otherwise, which the strict reward scores 0), so the fine-tuned
model computes every answer right but, greedily decoded, writes the subtractions' and
multiplications' answers in the unrewarded form. This mirrors verl's GSM8K quick start, where
the reward rises mostly as the model learns the `#### n` format: the GRPO gain of
`configs/quickstart.py` is learning the format, not learning arithmetic.

Plain next-token cross-entropy on the response tokens only (token mean over the batch), AdamW
(lr 5e-4, 20 warmup steps, cosine decay to 5e-5); no packing. The result (an HF checkpoint with
the tokenizer) is what `configs/quickstart.py` starts GRPO from. Measured: 600 steps of 64
examples (~1.9 epochs of the 20,000 rows) in 19 min 31 s wall (9 min 35 s user CPU) on the
shared 2-core CPU (load 5-8; 1.6-2.2 s per step); loss 0.080 nats per response token over the
last 50 steps, against a floor of 0.072 set by the teacher's coin flip between the two answer
forms. Greedy decoding of the result on the 256 held-out problems: the right number on 256 of
256, in the `#### n` form on all 82 additions and none of the 174 others, so 32.0% accuracy
under the strict reward. (Pilots: 300 steps at lr 1e-3 stopped at loss 0.19 with 66% of the
numbers right; at lr 2e-3 the loss was still 0.32 after 520 of 700 steps.)
"""

import os

import hybridjax
from hybridjax.offline.sft import sft_config

TOKENIZER = os.path.join(os.path.dirname(hybridjax.__file__), "assets", "tokenizers", "gsm8k_bpe")

# The quick start's model: 4 layers, width 256, 4 heads of 64; 3,423,488 parameters (256,000 of
# them the tied 1,000-token embedding), 13.7 MB in float32.
MODEL = dict(
    hidden_size=256,
    intermediate_size=688,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=4,
    max_position_embeddings=128,
    attention_bias=True,  # Qwen2 has q/k/v biases
    tie_word_embeddings=True,
)


def get_config():
    c = sft_config()
    c.data.train_files = "data/arithmetic/sft.parquet"
    c.data.tokenizer = TOKENIZER
    c.data.max_length = 40
    c.data.train_batch_size = 64
    c.model.override_config = MODEL
    c.optim.lr = 5e-4
    c.optim.lr_warmup_steps = 20
    c.optim.warmup_style = "cosine"
    c.optim.min_lr_ratio = 0.1
    c.trainer.experiment_name = "sft_arithmetic"
    c.trainer.total_training_steps = 600
    c.trainer.save_freq = 100
    return c
