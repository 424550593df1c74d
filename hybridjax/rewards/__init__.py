"""hybridjax.rewards."""
