"""The training core that the RL trainer (`hybridjax.rl`), the offline trainers
(`hybridjax.offline`) and the memory planner (`hybridjax.memory`) share: the models and their
train states built on their meshes (`build`), the optimizer (`optim`), the update loop over
micro-batches (`update`), the response log-probs (`forward`), the jitted device passes of an RL
step (`passes`) and its batch (`batch`), sequence packing (`packing`), and what stays on the
devices between stages (`offload`, `residency`). It imports only the layers below it (rewards,
rollout, data, checkpointing, metrics, tools, sharding, models, algorithms), never `config`,
`rl` or `offline` (docs/architecture.md, "The layers")."""
