"""Cost of the actor's forward+backward: hybridjax (XLA CPU) against torch + HF transformers.

Both systems run the same exported checkpoint (`hybridjax.models.hf_io.save_pretrained` of a
seeded random Qwen2-shaped model) on the same token ids, masks and positions, one thread each,
and differentiate the same loss: the token-mean over response tokens of −log π(response_t),
with the LM head on the response positions only on the torch side (`logits_to_keep`, as TRL
calls it) and whatever `hybridjax.training.forward.response_log_probs` does on ours. Each system
runs in its own process (`XLA_FLAGS=--xla_cpu_multi_thread_eigen=false`,
`torch.set_num_threads(1)`); a process times `warmup` calls,
then `repeats` calls, and reports the medians of CPU seconds (`time.process_time`, all threads)
and wall seconds. The loss values of the two systems are compared as a check that they compute
the same thing.

Workloads: `a` — the peer comparison's model a (hidden 256, 4 layers, 4/2 heads, MLP 688,
vocab 1024), 32 rows × (185 prompt + 64 response) tokens; `b` — the ~100M model (hidden 768,
16 layers, 12/4 heads, MLP 2048), 4 rows × (64 + 128) tokens.

    python -m experiments.benchmarks.update_cost [--workloads a,b] [--repeats 5] [--out DIR]

Writes `DIR/update_cost.json` (default `results/YYYYMMDD_HHMMSS/`). `--entropy` also times
hybridjax's actor loss as `update_actor` calls it (entropy as a stop-gradient metric).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import statistics
import subprocess
import sys
import time

import numpy as np

from experiments.benchmarks.requirements import MissingRequirement, require
from experiments.peers.workload import WORKLOADS as PEER_WORKLOADS

ROOT = pathlib.Path(__file__).resolve().parents[2]
SINGLE_THREAD_XLA = "--xla_cpu_multi_thread_eigen=false"

WORKLOADS = {
    "a": dict(
        model=PEER_WORKLOADS["a"]["model"],
        rows=32,
        prompt_length=185,
        response_length=64,
        warmup=2,
    ),
    "b": dict(
        model=PEER_WORKLOADS["b"]["model"],
        rows=4,
        prompt_length=64,
        response_length=128,
        warmup=1,
    ),
    "tiny": dict(  # a smoke test of the harness, not a measurement
        model=dict(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=1,
        ),
        rows=4,
        prompt_length=12,
        response_length=8,
        warmup=1,
    ),
}
VOCAB = 1024


def make_inputs(rows: int, prompt_len: int, response_len: int, seed: int = 0) -> dict:
    """Left-padded prompts ++ right-padded responses, as the rollout hands them to the trainer.

    Row r has r·7 mod (P/4) prompt pads and r·5 mod (R/4) response pads, so masks are ragged.
    Returns int32 `input_ids`, `attention_mask`, `position_ids` B×(P+R), `responses` B×R and
    float32 `response_mask` B×R.
    """
    rng = np.random.default_rng(seed)
    ids = rng.integers(2, VOCAB, size=(rows, prompt_len + response_len), dtype=np.int32)
    mask = np.ones_like(ids)
    for r in range(rows):
        mask[r, : (r * 7) % max(prompt_len // 4, 1)] = 0
        pad = (r * 5) % max(response_len // 4, 1)
        if pad:
            mask[r, -pad:] = 0
    ids = np.where(mask == 1, ids, 0).astype(np.int32)
    positions = np.maximum(np.cumsum(mask, axis=1) - 1, 0).astype(np.int32)
    return dict(
        input_ids=ids,
        attention_mask=mask.astype(np.int32),
        position_ids=positions,
        responses=ids[:, prompt_len:],
        response_mask=mask[:, prompt_len:].astype(np.float32),
    )


def export_checkpoint(spec: dict, model_dir: pathlib.Path) -> int:
    """Writes a seeded random Qwen2-shaped model as an HF checkpoint; returns its size."""
    from flax import nnx

    from hybridjax.models.config import ModelConfig
    from hybridjax.models.decoder import CausalLM
    from hybridjax.models.hf_io import save_pretrained

    config = ModelConfig(
        vocab_size=VOCAB,
        max_position_embeddings=1024,
        attention_bias=True,  # Qwen2's q/k/v biases
        family="qwen2",
        **spec["model"],
    )
    save_pretrained(CausalLM(config, nnx.Rngs(0)), model_dir)
    return config.num_params()


def _timed(step, warmup: int, repeats: int) -> dict:
    """Runs `step()` (which must block until its result is ready) warmup + repeats times."""
    first = time.perf_counter()
    step()
    first = time.perf_counter() - first
    for _ in range(warmup - 1):
        step()
    cpu, wall = [], []
    for _ in range(repeats):
        c, w = time.process_time(), time.perf_counter()
        loss = step()
        cpu.append(time.process_time() - c)
        wall.append(time.perf_counter() - w)
    return dict(
        first_call_s=first,
        cpu_s=statistics.median(cpu),
        wall_s=statistics.median(wall),
        cpu_s_all=cpu,
        wall_s_all=wall,
        loss=float(loss),
    )


def run_hybridjax(model_dir: str, inputs: dict, warmup: int, repeats: int, entropy: bool) -> dict:
    """Times jit(value_and_grad(token-mean −log π)) of `response_log_probs` on one CPU device."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from hybridjax.models.hf_io import load_pretrained
    from hybridjax.training.forward import response_log_probs

    graphdef, params = nnx.split(load_pretrained(model_dir))
    fields = {k: jnp.asarray(v) for k, v in inputs.items()}

    def loss_fn(params, fields):
        log_probs, ent = response_log_probs(graphdef, params, fields, 1.0, with_entropy=entropy)
        mask = fields["response_mask"]
        loss = -jnp.sum(log_probs * mask) / jnp.sum(mask)
        if entropy:  # as `update_actor` with entropy_coeff 0: a metric, no backward through it
            loss = loss + 0.0 * jax.lax.stop_gradient(jnp.sum(ent * mask))
        return loss

    grad_fn = jax.jit(jax.value_and_grad(loss_fn))

    def step():
        loss, grads = grad_fn(params, fields)
        jax.block_until_ready(grads)
        return loss

    out = _timed(step, warmup, repeats)
    out["versions"] = dict(jax=jax.__version__)
    return out


def run_torch(model_dir: str, inputs: dict, warmup: int, repeats: int, attn: str) -> dict:
    """Times forward+backward of HF transformers' Qwen2 with the same loss, one thread."""
    import torch
    import transformers

    torch.set_num_threads(1)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation=attn
    )
    model.train()
    t = {k: torch.from_numpy(v) for k, v in inputs.items()}
    response_len = t["responses"].shape[1]

    def step():
        model.zero_grad(set_to_none=True)
        logits = model(
            input_ids=t["input_ids"].long(),
            attention_mask=t["attention_mask"].long(),
            position_ids=t["position_ids"].long(),
            logits_to_keep=response_len + 1,
        ).logits[:, :-1]
        log_probs = torch.log_softmax(logits.float(), dim=-1)
        token = torch.gather(log_probs, -1, t["responses"].long()[..., None])[..., 0]
        loss = -(token * t["response_mask"]).sum() / t["response_mask"].sum()
        loss.backward()
        return loss.item()

    out = _timed(step, warmup, repeats)
    out["versions"] = dict(torch=torch.__version__, transformers=transformers.__version__)
    out["attn_implementation"] = attn
    return out


def _child(args) -> None:
    inputs = dict(np.load(pathlib.Path(args.work) / "inputs.npz"))
    model_dir = str(pathlib.Path(args.work) / "model")
    if args.child == "hybridjax":
        out = run_hybridjax(model_dir, inputs, args.warmup, args.repeats, args.entropy)
    else:
        out = run_torch(model_dir, inputs, args.warmup, args.repeats, args.torch_attn)
    print("RESULT " + json.dumps(out), flush=True)


def _spawn(system: str, work: pathlib.Path, warmup: int, args, entropy: bool = False) -> dict:
    env = dict(os.environ)
    env["XLA_FLAGS"] = SINGLE_THREAD_XLA
    env["OMP_NUM_THREADS"] = "1"
    env["JAX_PLATFORMS"] = "cpu"
    cmd = [sys.executable, "-m", "experiments.benchmarks.update_cost", f"--child={system}"]
    cmd += [f"--work={work}", f"--warmup={warmup}", f"--repeats={args.repeats}"]
    cmd += [f"--torch_attn={args.torch_attn}"] + (["--entropy"] if entropy else [])
    proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{system} failed:\n{proc.stderr[-4000:]}")
    line = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")][-1]
    return json.loads(line[len("RESULT ") :])


def measure(name: str, args, out_dir: pathlib.Path) -> dict:
    """Exports workload `name`'s checkpoint and inputs, then times each system in turn."""
    from hybridjax.metrics.flops import training_flops
    from hybridjax.models.config import ModelConfig

    spec = WORKLOADS[name]
    work = out_dir / f"work_{name}"
    num_params = export_checkpoint(spec, work / "model")
    inputs = make_inputs(spec["rows"], spec["prompt_length"], spec["response_length"])
    np.savez(work / "inputs.npz", **inputs)
    config = ModelConfig(vocab_size=VOCAB, attention_bias=True, **spec["model"])
    seq_lens = inputs["attention_mask"].sum(axis=1)
    result = dict(
        workload=name,
        num_params=num_params,
        rows=spec["rows"],
        prompt_length=spec["prompt_length"],
        response_length=spec["response_length"],
        tokens=int(inputs["attention_mask"].size),
        training_flops=training_flops(config, seq_lens),
    )
    systems = ["hybridjax", "torch"] + (["hybridjax_entropy"] if args.entropy else [])
    for system in systems:
        base = system.removesuffix("_entropy")
        result[system] = _spawn(base, work, spec["warmup"], args, system.endswith("_entropy"))
        r = result[system]
        r["gflops_per_cpu_s"] = result["training_flops"] / r["cpu_s"] / 1e9
        print(
            f"{name} {system:18s} cpu {r['cpu_s']:.3f} s  wall {r['wall_s']:.3f} s  "
            f"loss {r['loss']:.6f}  first call {r['first_call_s']:.1f} s",
            flush=True,
        )
    result["cpu_ratio_hybridjax_over_torch"] = (
        result["hybridjax"]["cpu_s"] / result["torch"]["cpu_s"]
    )
    result["loss_abs_diff"] = abs(result["hybridjax"]["loss"] - result["torch"]["loss"])
    return result


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workloads", default="a,b")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default="")
    parser.add_argument("--torch_attn", default="sdpa", choices=["sdpa", "eager"])
    parser.add_argument("--entropy", action="store_true")
    parser.add_argument("--child", default="", help=argparse.SUPPRESS)
    parser.add_argument("--work", default="", help=argparse.SUPPRESS)
    parser.add_argument("--warmup", type=int, default=1, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    try:
        require("update_cost")
    except MissingRequirement as err:
        sys.exit(str(err))
    if args.child:
        return _child(args)
    stamp = datetime.datetime.now(datetime.UTC).strftime("%Y%m%d_%H%M%S")
    out_dir = pathlib.Path(args.out or ROOT / "results" / stamp)
    out_dir.mkdir(parents=True, exist_ok=True)
    results = [measure(name, args, out_dir) for name in args.workloads.split(",")]
    summary = dict(
        benchmark="update_cost",
        threads=1,
        repeats=args.repeats,
        load_average=os.getloadavg(),
        workloads=results,
    )
    path = out_dir / "update_cost.json"
    path.write_text(json.dumps(summary, indent=2))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
