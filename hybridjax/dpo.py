"""`python -m hybridjax.dpo --config=configs/dpo_arithmetic.py [--config.a.b=value ...]`

Preference training (DPO, IPO, cDPO); the trainer is `hybridjax.offline.dpo`.
"""

from hybridjax.offline.dpo import cli

if __name__ == "__main__":
    cli()
