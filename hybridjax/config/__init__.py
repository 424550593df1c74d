"""The run config: every key with its default (`schema`), the start-up check (`checks`), the
facts derived from it in one place (`roles`) and the resolved run (`run.resolve -> RunConfig`)."""
