"""The run config: the schema with every key's default (`schema`) and its checks (`checks`)."""
