"""`python -m hybridjax.sft --config=configs/sft_arithmetic.py [--config.a.b=value ...]`

Supervised fine-tuning; the trainer is `hybridjax.offline.sft`.
"""

from hybridjax.offline.sft import cli

if __name__ == "__main__":
    cli()
