"""hybridjax.data."""
