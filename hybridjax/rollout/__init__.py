"""hybridjax.rollout."""
