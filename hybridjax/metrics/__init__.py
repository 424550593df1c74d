"""hybridjax.metrics."""
