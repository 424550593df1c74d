"""hybridjax.algorithms."""
