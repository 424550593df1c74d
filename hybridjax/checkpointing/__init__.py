"""hybridjax.checkpointing."""
