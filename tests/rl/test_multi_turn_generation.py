"""The `gen` stage with multi-turn rollouts: the batch attends to tool tokens but masks them
from the loss, the trainer's log-probs equal the rollout's on model tokens, rewards see the
trajectory in `extra_info`, the metrics count turns and calls."""

import dataclasses

import jax
import numpy as np
import pyarrow.parquet as pq
import pytest
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from hybridjax.data import gsm8k
from hybridjax.models.config import ModelConfig
from hybridjax.models.tokenizer import Tokenizer
from hybridjax.rl.generation import generate_batch
from hybridjax.rl.multi_turn import MultiTurn, multi_turn_metrics
from hybridjax.rl.trainer import RLTrainer
from hybridjax.rollout import Engine, RolloutConfig, SamplingParams, generate
from hybridjax.tools import ToolCall, ToolExecutor
from hybridjax.tools.calculator import CalculatorTool
from hybridjax.tools.chat import ChatTools
from hybridjax.training.forward import response_log_probs
from tests.rl.tiny_run import GSM8K_JSONL, read_metrics, tiny_config
from tests.rollout.rollout_testing import make_model

TOKENIZER = "hybridjax/assets/tokenizers/gsm8k_bpe"
TOOLS = "configs/tools/calculator.yaml"


class CallsEveryTurn(ChatTools):
    """The random model writes no calls: each of its turns is read as one (real execution and
    rendering)."""

    def parse(self, turn_ids):
        return [ToolCall("calculator", {"expression": "6*7"})]


def test_multi_turn_batch_masks_log_probs_and_extra_info():
    tok = Tokenizer.from_pretrained(TOKENIZER)
    config = ModelConfig(
        vocab_size=tok.vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        eos_token_id=tok.eos_token_id,
    )
    model = make_model(config)  # weights from numpy: no initializer compiles
    engine = Engine(
        model, RolloutConfig(page_size=32, max_num_seqs=4, prompt_length=24, response_length=40)
    )
    tools = CallsEveryTurn(tok, ToolExecutor([CalculatorTool()]))
    multi_turn = MultiTurn(tools, max_assistant_turns=3, max_parallel_calls=1, tool_threads=2)
    chats = [[{"role": "user", "content": q}] for q in ("What is 6*7?", "Add 2 and 3.")]
    ids = [tok.apply_chat_template(c) for c in chats]
    width = max(map(len, ids))
    prompts = {
        "input_ids": np.array([[0] * (width - len(i)) + i for i in ids], np.int32),
        "attention_mask": np.array([[0] * (width - len(i)) + [1] * len(i) for i in ids]),
        "data_source": ["calc"] * 2,
        "ground_truth": ["42", "5"],
        "extra_info": [{"index": 0}, {"index": 1}],
        "row_mask": [True, True],
    }
    # a random model rarely emits EOS: its 7 most frequent tokens end a turn instead
    sampling = SamplingParams(n=2, temperature=1.0, max_tokens=40, seed=1)
    single = generate(engine, prompts["input_ids"], sampling, prompts["attention_mask"])
    stop = tuple(int(t) for t in np.argsort(np.bincount(single.responses.ravel()))[-7:])
    sampling = dataclasses.replace(sampling, stop_token_ids=stop)
    sharding = NamedSharding(Mesh(np.array(jax.devices()[:1]), ("data",)), PartitionSpec())
    batch, host = generate_batch(engine, prompts, sampling, 0, sharding, 0, multi_turn)

    tool_ids = tok.encode("\n<|im_start|>tool\n42<|im_end|>\n<|im_start|>assistant\n")
    mask = np.asarray(batch.response_mask).astype(bool)
    valid = np.asarray(batch.attention_mask)[:, width:]
    np.testing.assert_array_equal(valid, host.valid_mask)
    for row in range(4):
        info = host.extra_info[row]
        assert info["index"] == row // 2 and info["num_turns"] == host.num_turns[row]
        roles = [m["role"] for m in info["messages"]]
        assert roles == ["assistant", "tool"] * (len(roles) // 2) + ["assistant"] * (len(roles) % 2)
        tool_tokens = batch.responses[row][valid[row].astype(bool) & ~mask[row]].tolist()
        # each call ran; its answer was rendered once and appended, and is not trained on
        call = {"name": "calculator", "arguments": {"expression": "6*7"}}
        assert info["tool_calls"] == [call | {"response": "42", "error": False}] * (len(roles) // 2)
        answers = [m["content"] for m in info["messages"][1::2]]
        full = tok.decode(tool_ids, skip_special_tokens=False)
        assert all(a == full for a in answers[:-1]) and full.startswith(
            answers[-1] if answers else ""
        )
        assert len(tool_tokens) == sum(len(tok.encode(a)) for a in answers)
        assert tool_tokens[: len(tool_ids)] == tool_ids[: len(tool_tokens)]
    assert host.num_turns.max() >= 2 and host.tool_calls.sum() >= 1

    # the trainer's forward over the whole trajectory = the rollout's log-probs (model tokens)
    graphdef, params = nnx.split(model)
    fields = {
        "input_ids": batch.input_ids,
        "attention_mask": batch.attention_mask,
        "position_ids": batch.position_ids,
        "responses": batch.responses,
    }
    lp, _ = response_log_probs(graphdef, params, fields, 1.0)
    on = mask
    np.testing.assert_allclose(
        np.asarray(lp)[on], np.asarray(batch.rollout_log_probs)[on], atol=1e-5
    )
    assert np.all(np.asarray(batch.rollout_log_probs)[~on] == 0)

    metrics = multi_turn_metrics(host.num_turns, host.tool_calls, host.tool_errors, host.row_mask)
    assert metrics["multi_turn/num_turns_max"] == host.num_turns.max()
    assert metrics["multi_turn/tool_calls"] == host.tool_calls.mean()
    assert metrics["multi_turn/tool_errors"] == 0


@pytest.mark.slow
def test_recipe_steps_end_to_end(tmp_path):
    """The calculator-tool recipe's steps on the tiny config: `--multi-turn` preprocessing, the
    verl-format tool config, GRPO with `rollout.multi_turn.enable`; the multi-turn metrics are
    logged (the random model writes no calls, so every trajectory has one turn)."""
    full = tmp_path / "full"
    gsm8k.main(["--input", str(GSM8K_JSONL), "--output", str(full), "--multi-turn"])
    data = {}
    for split, rows in (("train", 16), ("test", 8)):
        data[split] = str(tmp_path / f"{split}.parquet")
        pq.write_table(pq.read_table(full / f"{split}.parquet").slice(0, rows), data[split])
    config = tiny_config(
        data,
        tmp_path / "run",
        **{
            "algorithm.adv_estimator": "grpo",
            "critic.enable": False,
            "actor_rollout_ref.rollout.n": 2,
            "data.max_prompt_length": 480,
            "actor_rollout_ref.rollout.prompt_length": 480,
            "trainer.total_training_steps": 1,
            "actor_rollout_ref.rollout.multi_turn.enable": True,
            "actor_rollout_ref.rollout.multi_turn.tool_config_path": TOOLS,
        },
    )
    trainer = RLTrainer(config)
    trainer.fit()
    trainer.close()
    metrics = read_metrics(tmp_path / "run")[1]
    assert metrics["multi_turn/num_turns_mean"] == 1 == metrics["multi_turn/num_turns_max"]
    assert metrics["multi_turn/tool_calls"] == 0 == metrics["multi_turn/tool_errors"]
    assert np.isfinite(metrics["actor/pg_loss"])
