"""Peer comparison: TRL, Tunix and hybridjax GRPO on identical workloads, alternating, same run.

Each system runs in its own process (TRL and Tunix in the virtualenvs that
`experiments/peers/setup_venvs.sh` makes; hybridjax in the project's). Rounds alternate the
order of the systems so slow drifts of a shared machine hit all of them alike. Per system and
workload the summary holds the median step time after warm-up (wall and process CPU seconds),
prompt+response tokens per second (median tokens / median step time) and the ratio to the
faster peer (> 1: hybridjax is faster).

Config keys (`benchmark.peers`): workloads ("a,b"), systems ("trl,tunix,hybridjax"), rounds,
steps (timed steps per run; 0 = the workload's default), torch_threads, xla_single_thread,
timeout_s.
"""

from __future__ import annotations

import json
import logging
import os
import pathlib
import statistics
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]
PEERS = ROOT / "experiments" / "peers"
PEER_SYSTEMS = ("trl", "tunix")
# hybridjax's stages in the table, in step order (`timing_s/<stage>`; `step` is the whole step)
STAGE_COLUMNS = ("gen", "sleep", "reward", "old_log_prob", "adv", "update_actor", "reshard", "step")
log = logging.getLogger(__name__)


def _python(system: str) -> str:
    if system == "hybridjax":
        return sys.executable
    path = PEERS / ".venvs" / system / "bin" / "python"
    if not path.exists():
        raise FileNotFoundError(f"{path} missing: run experiments/peers/setup_venvs.sh first")
    return str(path)


def _env(system: str, torch_threads: int, xla_single_thread: bool) -> dict[str, str]:
    """The environment of one system's process.

    `xla_single_thread` runs XLA's CPU code on one thread (as `torch_threads=1` does torch):
    on a machine shared with other work, XLA's multi-threaded ops lose far more wall time to
    oversubscription than their CPU time (measured here: a forward+backward pass 3.8 CPU-s
    took 35 s wall multi-threaded, 18 s single-threaded, at a load average of 13 on 2 cores).
    """
    env = dict(os.environ)
    env.pop("XLA_FLAGS", None)  # every JAX system sees the machine's one CPU device
    if system != "trl" and xla_single_thread:
        env["XLA_FLAGS"] = "--xla_cpu_multi_thread_eigen=false"
    if system == "trl":
        env["OMP_NUM_THREADS"] = str(torch_threads)
        if torch_threads > 1:
            env["OMP_WAIT_POLICY"] = "PASSIVE"  # busy-waiting OpenMP threads make 2-thread noisy
    env["TOKENIZERS_PARALLELISM"] = "false"
    return env


def build_workload(name: str) -> dict:
    """Builds (once) and returns the workload spec shared by all systems."""
    script = PEERS / "workload.py"
    subprocess.run([sys.executable, str(script), f"--name={name}"], check=True, cwd=ROOT)
    return json.loads((PEERS / ".work" / name / "workload.json").read_text())


def run_system(system: str, workload: str, steps: int, out: pathlib.Path, cfg) -> dict:
    """One process of `system` on `workload`; returns its JSON result (raises on failure)."""
    cmd = [_python(system), str(PEERS / f"run_{system}.py"), f"--workload={workload}"]
    cmd += [f"--out={out}"] + ([f"--steps={steps}"] if steps else [])
    log.info("running %s", " ".join(cmd))
    with open(out.with_suffix(".log"), "w") as logfile:
        subprocess.run(
            cmd,
            check=True,
            cwd=ROOT,
            env=_env(system, cfg.torch_threads, cfg.get("xla_single_thread", False)),
            stdout=logfile,
            stderr=subprocess.STDOUT,
            timeout=cfg.timeout_s,
        )
    return json.loads(out.read_text())


def summarize(runs: list[dict]) -> dict:
    """Medians over every timed step (after each run's warm-up) of one system on one workload."""
    walls, cpus, tokens = [], [], []
    for r in runs:
        w = r["warmup"]
        walls += r["step_times_s"][w:]
        cpus += r["step_cpu_times_s"][w:]
        tokens += r["tokens_per_step"][w:]
    wall, cpu, tok = (statistics.median(x) for x in (walls, cpus, tokens))
    return {
        "step_time_s": wall,
        # Robust to a system that overlaps the next rollout with this update (Tunix's async
        # data preparation), where single gaps between reward calls alternate long and short.
        "step_time_mean_s": sum(walls) / len(walls),
        "step_cpu_time_s": cpu,
        "tokens_per_step": tok,
        "tokens_per_s": tok / wall,
        "tokens_per_cpu_s": tok / cpu,
        "steps_per_hour": 3600.0 / wall,
        "timed_steps": len(walls),
        "all_step_times_s": walls,
    }


def stage_medians(runs: list[dict]) -> dict[str, float]:
    """hybridjax's `timing_s/<stage>` medians over every timed step (after each run's warm-up)
    of its runs on one workload, by stage name."""
    times: dict[str, list[float]] = {}
    for r in runs:
        for m in r["metrics"][r["warmup"] :]:
            for k, v in m.items():
                if k.startswith("timing_s/"):
                    times.setdefault(k.removeprefix("timing_s/"), []).append(v)
    return {k: statistics.median(v) for k, v in times.items()}


def add_ratios(table: dict[str, dict]) -> None:
    """Adds `ratio_vs_faster_peer` (tokens/s, > 1 = faster) to hybridjax's row in place."""
    peers = [table[s] for s in PEER_SYSTEMS if s in table]
    if "hybridjax" not in table or not peers:
        return
    row = table["hybridjax"]
    best = max(peers, key=lambda p: p["tokens_per_s"])
    best_cpu = max(peers, key=lambda p: p["tokens_per_cpu_s"])
    row["ratio_vs_faster_peer"] = row["tokens_per_s"] / best["tokens_per_s"]
    row["cpu_ratio_vs_faster_peer"] = row["tokens_per_cpu_s"] / best_cpu["tokens_per_cpu_s"]


def run(cfg, out_dir: pathlib.Path) -> dict:
    """Runs the comparison described by `cfg` (a ConfigDict); returns the summary dict."""
    systems = [s for s in cfg.systems.split(",") if s]
    result: dict = {"workloads": {}}
    for workload in [w for w in cfg.workloads.split(",") if w]:
        spec = build_workload(workload)
        runs: dict[str, list[dict]] = {s: [] for s in systems}
        for round_ in range(cfg.rounds):
            order = systems[round_ % len(systems) :] + systems[: round_ % len(systems)]
            for system in order:
                out = out_dir / f"{system}_{workload}_r{round_}.json"
                try:
                    runs[system].append(run_system(system, workload, cfg.steps, out, cfg))
                except (subprocess.SubprocessError, FileNotFoundError, OSError) as err:
                    log.error("%s on workload %s failed: %s", system, workload, err)
        table = {s: summarize(r) for s, r in runs.items() if r}
        add_ratios(table)
        if runs.get("hybridjax"):
            table["hybridjax"]["stages_s"] = stage_medians(runs["hybridjax"])
            table["hybridjax"]["mfu_actor"] = runs["hybridjax"][-1]["metrics"][-1].get(
                "perf/mfu/actor"
            )
        result["workloads"][workload] = {
            "num_params": spec["num_params"],
            "batch": f"{spec['num_prompts']} prompts x {spec['n']} samples",
            "prompt_lengths": spec["prompt_lengths"],
            "response_length": spec["response_length"],
            "fixed_response_length": spec["fixed_response_length"],
            "systems": table,
            "versions": {s: r[0]["versions"] for s, r in runs.items() if r},
        }
    return result


def markdown_table(summary: dict) -> str:
    """The benchmarks table (docs/benchmarks.md): one row per workload and system."""
    lines = [
        "| workload | system | s/step (wall) | CPU s/step | tokens/step | tokens/s | "
        "vs faster peer (wall / CPU) |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, w in summary["workloads"].items():
        for system, r in w["systems"].items():
            ratio = ""
            if "ratio_vs_faster_peer" in r:
                ratio = f"{r['ratio_vs_faster_peer']:.2f}× / {r['cpu_ratio_vs_faster_peer']:.2f}×"
            lines.append(
                f"| {name} ({w['num_params'] / 1e6:.1f}M) | {system} | {r['step_time_s']:.2f} | "
                f"{r['step_cpu_time_s']:.2f} | {r['tokens_per_step']:.0f} | "
                f"{r['tokens_per_s']:.0f} | {ratio} |"
            )
    workloads = summary["workloads"].items()
    stages = {n: w["systems"].get("hybridjax", {}).get("stages_s") for n, w in workloads}
    stages = {n: st for n, st in stages.items() if st}
    if stages:
        lines += ["", "hybridjax's stages (median s over the timed steps):", ""]
        lines += ["| workload | " + " | ".join(STAGE_COLUMNS) + " |"]
        lines += ["|---" * (len(STAGE_COLUMNS) + 1) + "|"]
        for n, st in stages.items():
            cells = [f"{st[c]:.3f}" if c in st else "" for c in STAGE_COLUMNS]
            lines.append(f"| {n} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def plot(summary: dict, out_dir: pathlib.Path) -> None:
    """Bar chart of prompt+response tokens/s per system and workload (`peers.png`), and the
    markdown table (`table.md`)."""
    (out_dir / "table.md").write_text(markdown_table(summary))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workloads = summary["workloads"]
    fig, axes = plt.subplots(1, len(workloads), figsize=(5 * len(workloads), 4), squeeze=False)
    for ax, (name, w) in zip(axes[0], workloads.items(), strict=True):
        systems = list(w["systems"])
        ax.bar(systems, [w["systems"][s]["tokens_per_s"] for s in systems], color="C0")
        ax.set_title(f"workload {name} ({w['num_params'] / 1e6:.1f}M params)")
        ax.set_ylabel("prompt+response tokens/s")
    fig.tight_layout()
    fig.savefig(out_dir / "peers.png", dpi=100)
    plt.close(fig)
