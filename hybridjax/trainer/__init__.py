"""hybridjax.trainer."""
