"""Frozen configuration of the rollout engine and of one request's sampling.

Both are built once on the host from `actor_rollout_ref.rollout.*` (verl's key names) and never
enter jitted code as a ConfigDict: the engine turns `SamplingParams` into per-slot arrays.
"""

from __future__ import annotations

import dataclasses
from typing import Any

ATTENTION_IMPLS = ("auto", "jnp", "pallas")
PAGE_ALLOCATIONS = ("on_demand", "reserve")


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How one prompt is sampled (vLLM's / verl's names).

    n: samples per prompt; they share the prompt's KV pages and are contiguous in the output.
    temperature: 0 means greedy (argmax); otherwise logits are divided by it before sampling.
    top_k: keep the k most likely tokens (-1 or 0: off). top_p: keep the smallest set of tokens
      whose probability (after temperature and top-k) reaches p (1.0: off).
    max_tokens: response length limit (verl's `rollout.response_length`), at least 1.
    stop_token_ids: extra ids that end a response (the stop token is part of the response).
    ignore_eos: when False, the model's `eos_token_id`(s) also end a response.
    seed: request seed (its low 31 bits); sample i of prompt j draws from
      fold_in(fold_in(key(seed), j), i), folded with the token index at each step, so
      tokens do not depend on batching, slot placement or the number of steps per host call.
    """

    n: int = 1
    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    max_tokens: int = 512
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    seed: int = 0

    def __post_init__(self):
        if self.n < 1:
            raise ValueError(f"n must be >= 1, got {self.n}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))

    @property
    def uses_filter(self) -> bool:
        """True when top-k or top-p truncates the distribution (needs a sort over the vocab)."""
        return self.temperature > 0 and (self.top_k > 0 or self.top_p < 1.0)

    @classmethod
    def from_config(cls, rollout: Any, *, validate: bool = False, seed: int = 0) -> SamplingParams:
        """From `actor_rollout_ref.rollout` (or its `val_kwargs` when `validate`).

        `do_sample=False` means greedy, as in verl.
        """
        src = rollout.val_kwargs if validate else rollout
        temperature = float(src.get("temperature", 1.0))
        if not src.get("do_sample", True):
            temperature = 0.0
        return cls(
            n=int(src.get("n", 1)),
            temperature=temperature,
            top_k=int(src.get("top_k", -1)),
            top_p=float(src.get("top_p", 1.0)),
            max_tokens=int(rollout.get("response_length", 512)),
            ignore_eos=bool(rollout.get("ignore_eos", False)),
            seed=seed,
        )


@dataclasses.dataclass(frozen=True)
class RolloutConfig:
    """Sizes and choices of the engine (static: changing them means new compiles).

    page_size: tokens per KV page. num_pages: pages per layer in the pool; None sizes the pool
      from `gpu_memory_utilization` × free device memory, and where the backend reports no
      memory statistics (CPU) to full-length sequences for the slots a rollout can fill
      (`default_num_pages`).
    max_num_seqs: decode slots (the decode batch). prompt_length / response_length: the longest
      prompt and response a slot holds; they fix the page-table width.
    attention_impl: the decode kernel: "auto" ("pallas" when the generation mesh's devices are
      GPUs, "jnp" elsewhere), "jnp" (an online softmax over blocks of pages), or "pallas" (our
      Pallas Triton kernel reading the pages in place, GPU only); see
      `hybridjax.rollout.decode_attention.select_decode_kernel`.
    decode_steps_per_call: decode steps run inside one jitted `lax.while_loop` per host round
      trip; the loop also stops early once enough slots finished to refill from the queue.
    min_prefill_bucket: smallest padded prompt length; prompt lengths and prefill batch sizes
      are padded to the next 2^k or 3·2^(k-1) from there (one compile per bucket).
    page_allocation: "on_demand" (vLLM's block manager: a sequence takes a page when it grows
      into one; when a replica's pool runs out, its youngest sequences are preempted and
      recomputed later, `hybridjax.rollout.preemption`) or "reserve" (every sample's worst
      case, prompt + max_tokens, is reserved at admission: no preemption, fewer sequences).
    max_num_batched_tokens: tokens a data-parallel replica computes per engine step (vLLM's
      key): the running sequences' tokens of the step's decode call first (each
      min(decode_steps_per_call, tokens left)), prompt tokens to prefill in what is left;
      enable_chunked_prefill: a prompt longer than what is left of it is prefilled in chunks
      over several steps, the running sequences decoding in between (else it waits whole for
      a step of its own).
    watermark: with "on_demand", the fraction of a replica's pool a new group (or a preempted
      sequence coming back) must leave free after its pages to be admitted (vLLM's block
      manager's `watermark`, 0.01: int(0.01 × pages) pages), room for the running sequences
      to grow before one is preempted.
    enable_rollout_routing_replay: a MoE model's engine records the experts every prompt and
      generated token used in each MoE layer (`Engine.routing_of`), for the training passes
      to replay (verl's key; `actor.router_replay.mode` "R3").
    batch_seqs: the most sequences one `generate` call of the trainer submits (its rows:
      prompts × n, the larger of training and validation), or None when unknown. It bounds
      only the pool sized without memory statistics (`default_num_pages`): slots beyond it
      never fill, so their pages would be allocated, and zeroed at every wake-up after
      `sleep`, for nothing.
    """

    page_size: int = 16
    num_pages: int | None = None
    gpu_memory_utilization: float = 0.5
    max_num_seqs: int = 32
    prompt_length: int = 512
    response_length: int = 512
    attention_impl: str = "auto"
    decode_steps_per_call: int = 32
    min_prefill_bucket: int = 16
    page_allocation: str = "on_demand"
    max_num_batched_tokens: int = 8192
    enable_chunked_prefill: bool = True
    enable_rollout_routing_replay: bool = False
    watermark: float = 0.01
    batch_seqs: int | None = None

    def __post_init__(self):
        if self.page_allocation not in PAGE_ALLOCATIONS:
            raise ValueError(
                f"unknown page_allocation {self.page_allocation!r}; expected one of "
                f"{PAGE_ALLOCATIONS}"
            )
        if self.attention_impl not in ATTENTION_IMPLS:
            raise ValueError(
                f"unknown attention_impl {self.attention_impl!r}; expected one of {ATTENTION_IMPLS}"
            )
        if self.max_num_batched_tokens < 1:
            raise ValueError(
                f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}"
            )
        if self.page_size < 1 or self.max_num_seqs < 1 or self.decode_steps_per_call < 1:
            raise ValueError(f"page_size, max_num_seqs, decode_steps_per_call must be >= 1: {self}")
        if self.batch_seqs is not None and self.batch_seqs < 1:
            raise ValueError(f"batch_seqs must be >= 1 or None, got {self.batch_seqs}")
        if not 0.0 <= self.watermark < 1.0:
            raise ValueError(f"watermark must be in [0, 1), got {self.watermark}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}"
            )

    @property
    def max_seq_len(self) -> int:
        """Longest prompt + response a slot holds (positions 0 .. max_seq_len - 1)."""
        return self.prompt_length + self.response_length

    @property
    def pages_per_seq(self) -> int:
        """Width of a slot's page table: pages for positions 0 .. max_seq_len - 2 (the last
        sampled token is never fed back, so its key/value is never stored)."""
        return -(-(self.max_seq_len - 1) // self.page_size)

    @property
    def default_num_pages(self) -> int:
        """Pool size when no memory statistics exist: every slot a rollout can fill
        (`max_num_seqs`, at most `batch_seqs`) at full length, so nothing is preempted."""
        return min(self.max_num_seqs, self.batch_seqs or self.max_num_seqs) * self.pages_per_seq

    @classmethod
    def from_config(cls, rollout: Any, batch_seqs: int | None = None) -> RolloutConfig:
        """From `actor_rollout_ref.rollout` (`num_pages` <= 0 means "size from memory") and
        the run's `batch_seqs` (`run_batch_seqs`; None: unknown)."""
        num_pages = int(rollout.get("num_pages", -1))
        return cls(
            batch_seqs=batch_seqs,
            page_size=int(rollout.get("page_size", 16)),
            num_pages=num_pages if num_pages > 0 else None,
            gpu_memory_utilization=float(rollout.get("gpu_memory_utilization", 0.5)),
            max_num_seqs=int(rollout.get("max_num_seqs", 32)),
            prompt_length=int(rollout.get("prompt_length", 512)),
            response_length=int(rollout.get("response_length", 512)),
            attention_impl=str(rollout.get("attention_impl", "auto")),
            decode_steps_per_call=int(rollout.get("decode_steps_per_call", 32)),
            min_prefill_bucket=int(rollout.get("min_prefill_bucket", 16)),
            page_allocation=str(rollout.get("page_allocation", "on_demand")),
            max_num_batched_tokens=int(rollout.get("max_num_batched_tokens", 8192)),
            enable_chunked_prefill=bool(rollout.get("enable_chunked_prefill", True)),
            watermark=float(rollout.get("watermark", 0.01)),
            enable_rollout_routing_replay=bool(rollout.get("enable_rollout_routing_replay", False)),
        )


def run_batch_seqs(cfg: Any) -> int:
    """`RolloutConfig.batch_seqs` of the trainer's engine for the run config `cfg`: the rows
    of one generation call, the larger of a training batch (`data.train_batch_size` ×
    `rollout.n`) and a validation batch (`data.val_batch_size`, -1: `train_batch_size`, ×
    `rollout.val_kwargs.n`); a reward baseline's greedy rows and a dynamic sampling batch are
    no more. Sequences beyond the pool (partial rollouts carried over) wait for pages or are
    preempted, as with any pool."""
    data, rollout = cfg.data, cfg.actor_rollout_ref.rollout
    val = data.val_batch_size if data.val_batch_size > 0 else data.train_batch_size
    return max(data.train_batch_size * rollout.n, val * rollout.val_kwargs.n)
