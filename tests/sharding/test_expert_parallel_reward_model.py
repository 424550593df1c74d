"""Expert parallelism in the RL step's reward-model pass: a tiny MoE reward model on
mesh.train data 2 × expert 2 × fsdp 2 (8 CPU devices) scores inside the expert mesh
(`RewardStage.model_scores`) and equals the unpartitioned forward on one device within 1e-5."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from hybridjax.models.decoder import SequenceClassifier
from hybridjax.rewards import RewardConfig, RewardManager
from hybridjax.rewards.reward_model import score_responses
from hybridjax.rl import reward as reward_stage
from hybridjax.sharding import ACTOR_TRAIN_RULES, MeshConfig, make_meshes, state_shardings
from hybridjax.sharding.roles import batch_sharding
from hybridjax.training.batch import make_batch
from tests.sharding.test_expert_parallel_offline import MOE


def test_moe_reward_model_scores_on_the_expert_mesh(monkeypatch):
    graphdef, params = nnx.split(SequenceClassifier(MOE, nnx.Rngs(0)))
    rng = np.random.default_rng(0)
    spread = lambda x: jnp.asarray(0.2 * rng.standard_normal(x.shape), x.dtype) if x.ndim > 1 else x
    params = jax.tree.map(spread, params)
    responses_mask = (np.arange(4)[None] < rng.integers(1, 5, 8)[:, None]).astype(np.float32)
    batch = make_batch(
        jnp.asarray(rng.integers(1, MOE.vocab_size, (8, 3))),
        jnp.ones((8, 3), jnp.int32),
        jnp.asarray(rng.integers(1, MOE.vocab_size, (8, 4)) * responses_mask.astype(int)),
        jnp.asarray(responses_mask),
    )
    prompt_mask = batch.attention_mask[:, :3]
    ref, _ = score_responses(
        graphdef, params, batch.prompts, prompt_mask, batch.responses, batch.response_mask
    )

    mesh = make_meshes(MeshConfig(train=(2, 2, 2, 1), generate=(-1, 1))).train
    sharded = jax.device_put(params, state_shardings(params, mesh, ACTOR_TRAIN_RULES))
    rows = batch_sharding(mesh)
    seen = []

    def recording(*args, **kwargs):  # the mesh the stage calls the jitted forward under
        seen.append(dict(jax.sharding.get_abstract_mesh().shape))
        return score_responses(*args, **kwargs)

    monkeypatch.setattr(reward_stage, "score_responses", recording)
    stage = reward_stage.RewardStage(
        RewardManager(RewardConfig()), None, (graphdef, sharded), 1, rows, 8
    )
    try:
        scores, moved = stage.model_scores(jax.device_put(batch, rows))
    finally:
        stage.close()
    assert seen == [{"data": 2, "expert": 2, "fsdp": 2, "tensor": 1}] and moved == 0
    assert float(jnp.abs(ref).max()) > 0.1
    np.testing.assert_allclose(scores, ref, atol=1e-5)
