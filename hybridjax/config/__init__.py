"""The run config: every key with its default (`schema`), the start-up check of the config
(`checks`; the RL run's adds its own, `hybridjax.rl.checks`) and the resolved run
(`run.resolve -> RunConfig`, with the facts of `hybridjax.sharding.roles`)."""
