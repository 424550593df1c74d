"""DPO on arithmetic preference pairs from the quick start's SFT warm start (CPU, minutes).

    python -m hybridjax.data.arithmetic_pairs --input hybridjax/assets/quickstart/data \
        --output data/arithmetic_pairs
    python -m hybridjax.dpo --config=configs/dpo_arithmetic.py

Pairs (`hybridjax.data.arithmetic_pairs`): chosen `#### n`, rejected `Answer: n` (the form the
warm start prefers on subtractions and multiplications) or a wrong `#### m`. Sigmoid DPO loss
(beta 0.1), reference = the warm start (log-probs computed once), AdamW lr 1e-4 constant,
32 pairs per step, 40 steps; validation on the 256 held-out pairs before training and every 20
steps. Add `--config.model.lora_rank=16 --config.optim.lr=3e-4` for LoRA (adapters only;
measured: greedy accuracy 32.0% → 96.1%; at lr 1e-3 DPO over-optimises and greedy decoding
breaks).
`python -m experiments.examples.dpo_arithmetic` runs all of it and measures greedy accuracy.
"""

import os

import hybridjax
from hybridjax.offline.dpo import dpo_config

ASSETS = os.path.join(os.path.dirname(hybridjax.__file__), "assets", "quickstart")


def get_config():
    c = dpo_config()
    c.data.train_files = "data/arithmetic_pairs/train.parquet"
    c.data.val_files = "data/arithmetic_pairs/test.parquet"
    c.data.max_length = 40
    c.data.train_batch_size = 32
    c.model.path = os.path.join(ASSETS, "sft_model")
    c.dpo.beta = 0.1
    c.dpo.loss_type = "sigmoid"
    c.optim.lr = 1e-4
    c.optim.weight_decay = 0.0
    c.trainer.experiment_name = "dpo_arithmetic"
    c.trainer.default_local_dir = "checkpoints/hybridjax/dpo_arithmetic"
    c.trainer.total_training_steps = 40
    c.trainer.test_freq = 20
    c.trainer.val_before_train = True
    c.trainer.save_freq = -1
    return c
