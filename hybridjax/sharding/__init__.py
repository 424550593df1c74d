"""hybridjax.sharding."""
