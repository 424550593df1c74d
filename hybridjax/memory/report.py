"""The memory plan and its report: per-stage peaks (`StagePlan`), the verdict and the table
(`MemoryPlan.report`), and what to change when a stage does not fit (`advise`). The numbers
come from `hybridjax.memory.planner.plan_memory`.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from ml_collections import ConfigDict

GB = 1e9


@dataclasses.dataclass(frozen=True)
class StagePlan:
    """Per-device bytes while one stage runs: `consumers` (name → bytes) sum to `peak`."""

    name: str
    consumers: dict[str, int]

    @property
    def peak(self) -> int:
        return sum(self.consumers.values())


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
    """The plan of one config on `devices` devices of `capacity` bytes each."""

    devices: int
    capacity: int
    stages: tuple[StagePlan, ...]
    kv_pages: int
    kv_page_bytes: int  # one page over all layers, k and v, per device
    # full-length sequences the pool holds: all it runs with page_allocation "reserve"; with
    # "on_demand" (pages as sequences grow) a floor, shorter ones run beyond it
    full_sequences: int
    advice: tuple[str, ...]
    # stage → XLA's CPU memory analysis: scratch of the program compiled here (reference only:
    # the CPU compiler keeps buffers a GPU fusion does not; `hybridjax.memory.counts`)
    xla_cpu_scratch: dict[str, int] = dataclasses.field(default_factory=dict)
    # stage → XLA:GPU's bytes on compile-only GPUs (`memory.xla_gpu`): arguments, outputs,
    # aliased, scratch, the stage's peak from them, and for updates the resharded state leaves
    xla_gpu: dict[str, dict[str, int]] = dataclasses.field(default_factory=dict)

    @property
    def worst(self) -> StagePlan:
        return max(self.stages, key=lambda s: s.peak)

    @property
    def fits(self) -> bool:
        """Every stage's counted peak, and XLA:GPU's where compiled, within capacity (and no
        program XLA:GPU could not compile)."""
        if any("error" in x for x in self.xla_gpu.values()):
            return False
        xla = max((x["peak"] for x in self.xla_gpu.values()), default=0)
        return max(self.worst.peak, xla) <= self.capacity

    def to_dict(self) -> dict[str, Any]:
        return {
            "devices": self.devices,
            "capacity_bytes": self.capacity,
            "fits": self.fits,
            "worst_stage": self.worst.name,
            "kv_pages": self.kv_pages,
            "kv_page_bytes": self.kv_page_bytes,
            "kv_full_sequences": self.full_sequences,
            "stages": {s.name: {"peak_bytes": s.peak, **s.consumers} for s in self.stages},
            "xla_cpu_scratch_bytes": dict(self.xla_cpu_scratch),
            "xla_gpu": {k: dict(v) for k, v in self.xla_gpu.items()},
            "advice": list(self.advice),
        }

    def report(self) -> str:
        """A human-readable table: per-stage peak, verdict, largest consumers, what to change."""
        lines = [f"per-device memory on {self.devices} devices of {size(self.capacity)}:"]
        if self.xla_gpu:
            lines.append(f"  {'stage':<14} {'XLA:GPU':>10} {'counted':>10}  ratio")
        for s in self.stages:
            peak = self.xla_gpu.get(s.name, {}).get("peak", s.peak)
            mark = "" if max(peak, s.peak) <= self.capacity else "  <-- does not fit"
            if "error" in self.xla_gpu.get(s.name, {}):
                lines.append(f"  {s.name:<14} {'error':>10} {size(s.peak):>10}  (see below)")
            elif self.xla_gpu and s.name in self.xla_gpu:
                lines.append(
                    f"  {s.name:<14} {size(peak):>10} {size(s.peak):>10}  {peak / s.peak:.2f}{mark}"
                )
            elif self.xla_gpu:
                lines.append(f"  {s.name:<14} {'-':>10} {size(s.peak):>10}{mark}")
            else:
                lines.append(f"  {s.name:<14} {size(s.peak):>10}{mark}")
        w = self.worst
        verdict = "fits" if self.fits else "does NOT fit"
        for name, x in self.xla_gpu.items():
            if "error" in x:
                lines.append(f"XLA:GPU cannot compile {name}: {x['error']}")
        lines.append(
            f"{verdict}: peak {size(w.peak)} in {w.name} "
            f"({w.peak / self.capacity:.0%} of {size(self.capacity)})"
        )
        if peaks := {k: x["peak"] for k, x in self.xla_gpu.items() if "peak" in x}:
            worst = max(peaks, key=lambda k: peaks[k])
            lines.append(f"XLA:GPU's peak: {size(peaks[worst])} in {worst}")
        lines.append(f"largest consumers in {w.name}:")
        for name, b in sorted(w.consumers.items(), key=lambda kv: -kv[1])[:6]:
            lines.append(f"  {name:<28} {size(b):>10}")
        lines.append(
            f"KV pool: {self.kv_pages} pages of {self.kv_page_bytes / 1e6:.2f} MB "
            f"({self.full_sequences} full-length sequences)"
        )
        lines += [f"change: {a}" for a in self.advice]
        return "\n".join(lines)


def size(nbytes: float) -> str:
    """`1.23 GB` (10^9 bytes) from 1 GB up, else `45.6 MB`."""
    return f"{nbytes / GB:.2f} GB" if abs(nbytes) >= GB else f"{nbytes / 1e6:.1f} MB"


def advise(plan: MemoryPlan, cfg: ConfigDict, train_mesh, devices: int) -> list[str]:
    """What to change: for each stage over capacity, worst first, the keys that shrink its
    largest consumers (each key once); and a KV pool too small for `max_num_seqs`."""
    a, r = cfg.actor_rollout_ref, cfg.actor_rollout_ref.rollout
    out: dict[str, str] = {}
    if plan.full_sequences < r.max_num_seqs:
        # "reserve" books each sequence's full length at admission, so slots past the pool's
        # full-length count stay empty; "on_demand" runs them while short and preempts
        # (recomputes) the youngest when they grow, so the count is a bound on the waste only
        on_demand = r.get("page_allocation", "on_demand") == "on_demand"
        effect = (
            "sequences past that many are preempted and recomputed as they grow"
            if on_demand
            else "slots wait for pages"
        )
        out["rollout.max_num_seqs"] = (
            f"the KV pool holds {plan.full_sequences} full-length sequences but "
            f"rollout.max_num_seqs is {r.max_num_seqs}: {effect}; raise "
            "rollout.gpu_memory_utilization or mesh.generate.tensor, or lower max_num_seqs"
        )
    fsdp, tensor = train_mesh.shape["fsdp"], train_mesh.shape["tensor"]
    expert = train_mesh.shape.get("expert", 1)  # kept: fsdp takes the devices data has
    for name, x in plan.xla_gpu.items():  # a program XLA:GPU cannot compile cannot run
        if "error" in x and name == "reward" and cfg.reward_model.model.use_remove_padding:
            out["compile reward"] = (
                "XLA:GPU cannot compile the packed reward-model scoring: "
                "reward_model.model.use_remove_padding=False scores padded rows instead"
            )
        elif "error" in x:
            out[f"compile {name}"] = f"XLA:GPU cannot compile {name}: see the error above"
    # a stage is over when its count or XLA:GPU's compiled peak is
    peak = lambda s: max(s.peak, plan.xla_gpu.get(s.name, {}).get("peak", 0))
    over = sorted((s for s in plan.stages if peak(s) > plan.capacity), key=lambda s: -peak(s))
    for s in over:
        c, why = s.consumers, f"{size(peak(s) - plan.capacity)} short in {s.name}"
        add = lambda key, text: out.setdefault(key, f"{why}: {text}")
        states = sum(v for k, v in c.items() if "params" in k or "optimizer" in k)
        if fsdp * tensor * expert < devices and states > 0.25 * s.peak:
            most = devices // (tensor * expert)
            add(
                "mesh.train.fsdp",
                f"mesh.train.data=1 mesh.train.fsdp={most} (now fsdp {fsdp}) splits params and "
                f"optimizer states {most} ways (about {size(states * (1 - fsdp / most))} less)",
            )
        live = lambda *parts: sum(c.get(f"{s.name} {k}", 0) for k in parts)
        scratch = live("activations", "logits")
        if s.name.startswith("update") and scratch > 0.2 * s.peak:
            role, key = (
                (a.actor, "actor_rollout_ref.actor")
                if s.name == "update_actor"
                else (cfg.critic, "critic")
            )
            if not a.model.enable_gradient_checkpointing and live("activations") > 0.1 * s.peak:
                add(
                    "remat",
                    "actor_rollout_ref.model.enable_gradient_checkpointing=True (rematerialise "
                    f"each layer; activations {size(live('activations'))})",
                )
            if role.ppo_micro_batch_size_per_gpu > 1:
                micro = role.ppo_micro_batch_size_per_gpu
                add(
                    f"{key}.micro",
                    f"{key}.ppo_micro_batch_size_per_gpu={micro // 2} (activations and logits, "
                    f"{size(scratch)}, shrink about linearly with it)",
                )
        if s.name in ("old_log_prob", "ref", "values") and scratch > 0.2 * s.peak:
            micro = max(r.log_prob_micro_batch_size_per_gpu // 2, 1)
            add("log_prob", f"actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu={micro}")
        pool = c.get("KV pool", 0)
        if pool > 0.2 * s.peak and s.name != "gen":
            short = plan.worst.peak - plan.capacity
            fit = ""
            frac = r.gpu_memory_utilization * (pool - short) / pool
            if r.num_pages <= 0 and frac >= 0.05:  # below that the pool is all but gone
                fit = f" (rollout.gpu_memory_utilization={math.floor(frac * 100) / 100:.2f} fits)"
            add(
                "pool",
                f"the KV pool ({size(pool)}) stays allocated through every stage: lower "
                f"rollout.gpu_memory_utilization{fit} or set rollout.num_pages",
            )
        if s.name == "gen":
            for role, key in (
                ("actor optimizer state", "actor_rollout_ref.actor.fsdp_config.optimizer_offload"),
                ("actor params", "actor_rollout_ref.actor.fsdp_config.param_offload"),
                ("ref params", "actor_rollout_ref.ref.fsdp_config.param_offload"),
            ):
                if c.get(role, 0) > 0.1 * s.peak:
                    add(key, f"{key}=True moves {size(c[role])} to host while generating")
        if s.name in ("gen", "reshard") and c.get("rollout weights", 0) > 0.2 * s.peak:
            add("tensor", "mesh.generate.tensor > 1 splits the rollout weights and KV pool")
    return list(out.values())
