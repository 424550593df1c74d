"""`python -m hybridjax.plan --config=configs/x.py --devices=8 --device_memory_gb=80`

Prints the per-device memory plan of a config; the planner is `hybridjax.memory.planner`.
"""

from hybridjax.memory.planner import cli

if __name__ == "__main__":
    cli()
