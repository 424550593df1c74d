"""Reward-stage time per step: where the reward function or the reward model runs.

Part `rule`: 128 responses per step, a custom rule function costing 5 ms per call, scored by
`hybridjax.rewards.RewardManager` (a) in 8 threads of the trainer, (b) in 8 worker processes
(the default for custom functions: isolated, with timeouts), (c) on one reward server
(`python -m hybridjax.rewards.serve`, 8 worker processes), (d) on two such servers. Two kinds of
5 ms: `cpu` (pure-Python work: holds the GIL, like a regex or sympy check) and `io` (a sleep:
releases it, like a call to a sandbox). Then the built-in GSM8K check (µs per row) on threads
and on processes: why built-ins stay on threads.

Part `model`: a reward model (a random Qwen2-shaped `SequenceClassifier`) scoring 128
(prompt, response) pairs (a) in the trainer: queued on the trainer's devices next to a
stand-in for the reference pass (a forward of the same model on the same batch), (b) served
on its own devices (a server process with its own simulated CPU devices), posted while the
trainer's devices run the stand-in. Reported: the time of both together and of the stand-in
alone; the difference is what the reward model adds to the step.

Each configuration runs `--warmup` steps (workers start, shapes compile), then `--steps`
timed ones; the median is reported. On CPU, "its own devices" share the machine's cores with
the trainer's (`os.cpu_count()` and the load average are recorded): the split pays on
separate accelerators, here it only shows the cost of the transport.

    python -m experiments.benchmarks.reward_service [--steps 5] [--parts rule,model] [--out DIR]

Writes `DIR/reward_service.json` (default `results/YYYYMMDD_HHMMSS/`).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import datetime
import json
import os
import pathlib
import statistics
import tempfile
import time

DEVICES = 4
os.environ.setdefault("XLA_FLAGS", f"--xla_force_host_platform_device_count={DEVICES}")

import numpy as np  # noqa: E402

from hybridjax.rewards import RewardConfig, RewardManager  # noqa: E402
from hybridjax.rewards.serve import start_local  # noqa: E402

ROWS = 128
RULE = """
import time

def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    start = time.perf_counter()
    if extra_info["kind"] == "io":
        time.sleep(0.005)
    else:
        while time.perf_counter() - start < 0.005:
            pass
    return float(solution_str.strip().endswith(str(ground_truth)))
"""


def _timed(fn, warmup: int, steps: int) -> dict:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return {"median_s": statistics.median(times), "times_s": times}


def _batch(kind: str, data_source: str = "custom"):
    responses = [f"The answer is #### {i % 7}" for i in range(ROWS)]
    truths = [str(i % 5) for i in range(ROWS)]
    extra = [{"kind": kind}] * ROWS
    return responses, [data_source] * ROWS, truths, extra, np.full(ROWS, 8), 16


def rule_part(warmup: int, steps: int, workers: int = 8) -> dict:
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "rule.py")
        pathlib.Path(path).write_text(RULE)
        servers = [start_local(["--custom_path", path, "--num_workers", str(workers)])
                   for _ in range(2)]  # fmt: skip
        urls = [url for _, url in servers]
        remote = lambda n: {"urls": ",".join(urls[:n]), "batch_size": 16, "concurrency": 8}
        namespace = {}
        exec(compile(RULE, path, "exec"), namespace)
        setups = {
            "threads": lambda: RewardManager(
                RewardConfig(num_workers=workers), namespace["compute_score"]
            ),
            "processes": lambda: RewardManager(RewardConfig(custom_path=path, num_workers=workers)),
            "one_server": lambda: RewardManager(
                RewardConfig.from_config({"reward_model": {"remote": remote(1)}})
            ),
            "two_servers": lambda: RewardManager(
                RewardConfig.from_config({"reward_model": {"remote": remote(2)}})
            ),
        }
        try:
            for kind in ("cpu", "io"):
                for name, make in setups.items():
                    manager = make()
                    out[f"{kind}/{name}"] = _timed(lambda: manager(*_batch(kind)), warmup, steps)
                    manager.close()
                    print(kind, name, f"{out[f'{kind}/{name}']['median_s']:.3f} s", flush=True)
        finally:
            for process, _ in servers:
                process.terminate()
                process.wait()
    for name, reward_manager in (("threads", "naive"), ("processes", "prime")):
        manager = RewardManager(RewardConfig(num_workers=workers, reward_manager=reward_manager))
        responses, sources, truths, _, lengths, width = _batch("cpu", "openai/gsm8k")
        batch = responses, sources, truths, None, lengths, width
        out[f"builtin_gsm8k/{name}"] = _timed(lambda: manager(*batch), warmup, steps)
        manager.close()
        print("builtin", name, f"{out[f'builtin_gsm8k/{name}']['median_s']:.4f} s", flush=True)
    return out


def model_part(warmup: int, steps: int, prompt: int = 64, response: int = 64) -> dict:
    import jax
    from flax import nnx
    from jax.sharding import NamedSharding, PartitionSpec

    from hybridjax.models import ModelConfig, SequenceClassifier
    from hybridjax.models.hf_io import save_pretrained
    from hybridjax.rewards.remote import RemoteClient, RemoteConfig
    from hybridjax.rewards.reward_model import score_responses
    from hybridjax.sharding import (
        BATCH_AXES,
        REWARD_MODEL_RULES,
        MeshConfig,
        init_sharded,
        make_meshes,
    )

    shape = ModelConfig(
        vocab_size=1024,
        hidden_size=128,
        intermediate_size=344,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        attention_bias=True,
        num_labels=1,
    )
    mesh = make_meshes(MeshConfig()).train
    model = init_sharded(SequenceClassifier, shape, mesh, REWARD_MODEL_RULES, 0)
    graphdef, state = nnx.split(model)
    rng = np.random.default_rng(0)
    ids_p = rng.integers(1, 1024, (ROWS, prompt)).astype(np.int32)
    ids_r = rng.integers(1, 1024, (ROWS, response)).astype(np.int32)
    masks = np.ones((ROWS, prompt), np.int32), np.ones((ROWS, response), np.int32)
    rows = NamedSharding(mesh, PartitionSpec(BATCH_AXES))
    batch = [jax.device_put(x, rows) for x in (ids_p, masks[0], ids_r, masks[1])]
    forward = lambda: score_responses(graphdef, state, *batch, micro_batch_size=32)[1]

    def in_trainer():
        scores, stand_in = forward(), forward()  # both queued on the trainer's devices
        jax.block_until_ready((scores, stand_in))

    out = {"stand_in_alone": _timed(lambda: jax.block_until_ready(forward()), warmup, steps)}
    out["in_trainer"] = _timed(in_trainer, warmup, steps)
    with tempfile.TemporaryDirectory() as tmp:
        save_pretrained(model, pathlib.Path(tmp) / "rm")
        env = os.environ | {"XLA_FLAGS": f"--xla_force_host_platform_device_count={DEVICES}"}
        process, url = start_local(["--model_path", str(pathlib.Path(tmp) / "rm"),
                                    "--micro_batch_size_per_device", "8"], env=env)  # fmt: skip
        client = RemoteClient(RemoteConfig(urls=(url,), batch_size=ROWS, timeout_s=600), "model")
        pool = concurrent.futures.ThreadPoolExecutor(1)

        def served():
            pending = pool.submit(client.score_tokens, ids_p.tolist(), ids_r.tolist())
            jax.block_until_ready(forward())
            assert all(o.kind == "ok" for o in pending.result())

        try:
            out["served"] = _timed(served, warmup, steps)
            out["served_request_alone"] = _timed(
                lambda: client.score_tokens(ids_p.tolist(), ids_r.tolist()), warmup, steps
            )
        finally:
            client.close()
            process.terminate()
            process.wait()
    for key, value in out.items():
        print("model", key, f"{value['median_s']:.3f} s", flush=True)
    return out | {
        "model": {
            "hidden_size": 128,
            "layers": 4,
            "rows": ROWS,
            "prompt": prompt,
            "response": response,
            "devices_each": DEVICES,
        }
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--parts", default="rule,model")
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    stamp = datetime.datetime.now().strftime("%Y%m%d_%H%M%S")
    out_dir = pathlib.Path(args.out or f"results/{stamp}")
    out_dir.mkdir(parents=True, exist_ok=True)
    result = {
        "machine": {"cpu_count": os.cpu_count(), "load_average_1m": os.getloadavg()[0]},
        "rows_per_step": ROWS,
        "rule_cost_ms": 5,
    }
    parts = args.parts.split(",")
    if "rule" in parts:
        result["rule"] = rule_part(args.warmup, args.steps)
    if "model" in parts:
        result["model"] = model_part(args.warmup, args.steps)
    result["machine"]["load_average_1m_after"] = os.getloadavg()[0]
    (out_dir / "reward_service.json").write_text(json.dumps(result, indent=2))
    print(f"wrote {out_dir / 'reward_service.json'}")


if __name__ == "__main__":
    main()
