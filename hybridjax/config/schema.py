"""The full RL trainer configuration: every key, its default, its check, and verl's name for it.

`base_config()` is the schema: a config file starts from it and changes values, and
`hybridjax.config.checks` rejects any key that is not here. Key names follow verl's
`ppo_trainer.yaml` (`data.*`, `actor_rollout_ref.{model,actor,ref,rollout}.*`, `critic.*`,
`reward_model.*`, `custom_reward_function.*`, `algorithm.*`, `trainer.*`), plus `mesh.*` for the
two device layouts of the hybrid engine and `resource_pool.*` / `placement.*` for the device
pools of the roles. Empty strings mean "not set" (ConfigDict fields keep
their type, so `None` defaults would break `--config.a.b=x` overrides).

A key's bounds and choices are written beside it (`positive(1024)`, `one_of("error", ...)`,
`hybridjax.config.fields`): `declared_config()` holds them, `base_config()` its defaults and
`declared_checks()` the checks the start-up validation applies and the reference prints.
"""

from __future__ import annotations

from typing import Any

from ml_collections import ConfigDict, FieldReference

from hybridjax.algorithms.advantages import ADV_ESTIMATORS
from hybridjax.algorithms.config import (
    KL_CTRL_TYPES,
    ROLLOUT_IS_LEVELS,
    ROLLOUT_IS_MODES,
    KLControlConfig,
)
from hybridjax.algorithms.distillation import DISTILLATION_LOSS_MODES
from hybridjax.algorithms.kl import KL_PENALTY_TYPES as KL_TYPES
from hybridjax.algorithms.loss_agg import LOSS_AGG_MODES
from hybridjax.algorithms.losses import POLICY_LOSSES
from hybridjax.algorithms.registry import ROLLOUT_REJECTIONS
from hybridjax.config.fields import (
    Checked,
    at_least,
    check,
    checks,
    one_of,
    positive,
    positive_or_unset,
    subset_of,
    within,
)
from hybridjax.data.dataset import SPECIAL_TOKENS_IN_CONTENT
from hybridjax.metrics.tracking import LOGGERS
from hybridjax.models.config import DTYPE_CHOICES, REMAT_POLICIES
from hybridjax.rewards.genrm import DEFAULT_TEMPLATE, VERDICT_PARSERS
from hybridjax.rewards.manager import COMBINE, ON_ERROR_POLICIES, REWARD_MANAGERS
from hybridjax.rollout.config import ATTENTION_IMPLS, PAGE_ALLOCATIONS

TRUNCATIONS = ("error", "left", "right", "middle")
ROLLOUT_NAMES = ("hybridjax",)  # the built-in paged engine; verl's vllm/sglang are not used
WARMUP_STYLES = ("constant", "cosine")
ROLLOUT_MODES = ("sync", "one_step_off", "async")
RECOMPUTE_OLD_LOG_PROB = ("auto", "true", "false")  # actor.recompute_old_log_prob
SCAN_LAYERS = ("auto", "true", "false")  # model.scan_layers
PARTIAL_ROLLOUT_KV = ("recompute", "keep")  # trainer.partial_rollout_kv
ROUTER_REPLAY_MODES = ("disabled", "R2", "R3")  # actor.router_replay.mode
LOG_PROB_SUPPORTS = ("auto", "replay", "full")  # rollout.log_prob_support


def _optim(lr: float) -> dict[str, Any]:
    return dict(
        lr=at_least(lr, 0),
        lr_warmup_steps=-1,  # -1: use lr_warmup_steps_ratio
        lr_warmup_steps_ratio=within(0.0, 0, 1),
        warmup_style=one_of("constant", WARMUP_STYLES),  # constant | cosine
        min_lr_ratio=within(0.0, 0, 1),
        weight_decay=at_least(0.01, 0),
        betas=(0.9, 0.999),
        total_training_steps=-1,  # -1: filled from the trainer's step count
    )


def _kl_ctrl(d: KLControlConfig) -> dict[str, Any]:
    return dict(
        type=check(d.type, lambda v: v in KL_CTRL_TYPES, " or ".join(KL_CTRL_TYPES)),
        kl_coef=at_least(d.kl_coef, 0),
        target_kl=positive(d.target_kl),
        horizon=positive(d.horizon),
    )


def base_config() -> ConfigDict:
    """Every trainer key with its default (verl's defaults where verl has the key)."""
    return _defaults(declared_config())


def declared_checks() -> list[tuple[str, Checked]]:
    """(dotted key, its declared check) for every checked key of `base_config()`, in order."""
    return list(checks(declared_config()))


def _defaults(cfg: ConfigDict) -> ConfigDict:
    """`cfg` with each checked field replaced, in place, by its default (key order and the
    shared `FieldReference`s of the run directory kept)."""
    for key, value in cfg.items(preserve_field_references=True):
        if isinstance(value, Checked):
            with cfg.ignore_type():
                cfg[key] = value.default
        elif isinstance(value, ConfigDict):
            _defaults(value)
    return cfg


def declared_config() -> ConfigDict:
    """Every trainer key with its default, and its check where it has one (`Checked` leaves)."""
    c = ConfigDict()
    c.data = dict(
        train_files=check("", bool, "must name at least one parquet file"),
        val_files="",
        tokenizer="",  # tokenizer.json path; "" = the model path's tokenizer
        prompt_key="prompt",
        max_prompt_length=positive(512),
        max_response_length=positive(512),
        train_batch_size=positive(1024),
        val_batch_size=-1,  # -1: the whole validation set in batches of train_batch_size
        truncation=check("error", lambda v: v in TRUNCATIONS, f"must be one of {TRUNCATIONS}"),
        filter_overlong_prompts=False,
        # message text that spells a special token (`<|im_end|>`): keep (as transformers: it
        # becomes that token) | escape (tokenised as plain text) | error; rows counted at load
        special_tokens_in_content=one_of("keep", SPECIAL_TOKENS_IN_CONTENT),
        shuffle=True,
        seed=1,
        val_max_samples=-1,  # -1: every validation row
    )
    c.actor_rollout_ref = dict(
        model=dict(
            path="",  # HF checkpoint dir; "" = random init from override_config
            override_config=ConfigDict(),  # ModelConfig fields that replace config.json's
            enable_gradient_checkpointing=False,
            # what a checkpointed layer saves: "full" (its input only) or
            # "dots_with_no_batch_dims" (also its weight matmuls' outputs, MaxText's "minimal");
            # read with enable_gradient_checkpointing=True (ModelConfig.remat_policy)
            remat_policy=one_of("full", REMAT_POLICIES),
            # the decoder layers' parameters stored stacked and run as one lax.scan (compiled
            # once) in training, log-prob and decode passes (ModelConfig.scan_layers), also the
            # critic's: "auto" on for dense models with enable_gradient_checkpointing, off for
            # MoE and without checkpointing; "true" refuses MoE models
            scan_layers=one_of("auto", SCAN_LAYERS, "strings"),
            # compute dtype of training matmuls; auto: bfloat16 on GPU/TPU, float32 on CPU
            dtype=one_of("auto", DTYPE_CHOICES),
            # LoRA (hybridjax.models.lora): rank 0 = full fine-tuning; target_modules is
            # "all-linear" (every attention and MLP projection) or names, e.g. "q_proj,v_proj"
            lora_rank=0,
            lora_alpha=16.0,
            target_modules="all-linear",
            # packed sequences (no padding) in the actor's, ref's and old-log-prob passes
            use_remove_padding=True,
            # the LM head fused with log-softmax and entropy, chunk by chunk over positions
            # (hybridjax.models.logprobs): no B×T×V logits in any pass
            use_fused_kernels=True,
            # parity mode (vLLM's "batch invariant"): the actor's passes and the rollout
            # engine reduce in one order whatever the batch, so rollout and trainer log-probs
            # are equal bit for bit (hybridjax.models.invariant, docs/batch-invariance.md);
            # needs use_remove_padding=False, a dense model, and the unfused head is used
            batch_invariant=False,
        ),
        actor=dict(
            ppo_mini_batch_size=positive(256),  # in prompts; × rollout.n responses
            ppo_micro_batch_size_per_gpu=positive(8),  # in responses, per data-parallel shard
            ppo_epochs=positive(1),
            shuffle=False,
            # micro-batches by token count (per device) instead of ppo_micro_batch_size_per_gpu
            use_dynamic_bsz=False,
            ppo_max_token_len_per_gpu=16384,
            use_prefix_sharing=True,  # the responses of a prompt share one copy of it
            # the separate old-log-prob pass: "auto" skips it when the update is on-policy (one
            # epoch, one mini-batch, nothing needs π_old before the update), "true" always runs
            # it, "false" never (rejected unless on-policy); see build.recompute_old_log_prob
            recompute_old_log_prob=one_of("auto", RECOMPUTE_OLD_LOG_PROB, "strings"),
            grad_clip=positive(1.0),
            clip_ratio=within(0.2, 0, 1, low_open=True, high_open=True),
            clip_ratio_low=check(  # 0: follow clip_ratio (verl's null)
                0.0, lambda v: 0 <= v < 1, "must be in (0, 1), or 0 to follow clip_ratio"
            ),
            clip_ratio_high=check(  # 0: follow clip_ratio
                0.0, lambda v: v >= 0, "must be > 0, or 0 to follow clip_ratio"
            ),
            clip_ratio_c=check(3.0, lambda v: v > 1, "must be > 1"),
            loss_agg_mode=one_of("token-mean", LOSS_AGG_MODES),
            loss_scale_factor=0.0,  # seq-mean-token-sum-norm divisor; 0 = response length
            policy_loss=dict(loss_mode=one_of("vanilla", POLICY_LOSSES.names)),
            entropy_coeff=at_least(0.0, 0),
            # without use_fused_kernels: the entropy recomputed in the backward (no softmax
            # kept) and computed over chunks of positions (verl's keys)
            entropy_checkpointing=True,
            entropy_from_logits_with_chunking=True,
            use_kl_loss=False,
            kl_loss_coef=at_least(0.001, 0),
            kl_loss_type=one_of("low_var_kl", KL_TYPES),
            # MoE models: weight of the router's load-balancing (Switch) loss added to the
            # actor's loss (Megatron's name, verl's megatron.override_transformer_config key);
            # 0 = off. HF's config.json router_aux_loss_coef is not read for training
            moe_aux_loss_coeff=at_least(0.0, 0, "0: off"),
            # MoE routing replay (verl's key): "R2" records each token's experts in the
            # old_log_prob pass and the update reuses them; "R3" replays the experts the
            # rollout engine recorded (rollout.enable_rollout_routing_replay) in the
            # old_log_prob pass and the update. Needs model.use_remove_padding=False
            router_replay=dict(mode=one_of("disabled", ROUTER_REPLAY_MODES)),
            optim=_optim(1e-6),
            # host memory while the rollout runs (verl's keys)
            fsdp_config=dict(param_offload=False, optimizer_offload=False),
        ),
        ref=dict(
            log_prob_micro_batch_size_per_gpu=positive(16),
            log_prob_use_dynamic_bsz=False,
            log_prob_max_token_len_per_gpu=16384,
            use_prefix_sharing=True,
            # model_dtype: the frozen copy's parameter dtype (bfloat16 halves it; auto as
            # model.dtype; not with LoRA, whose reference is the actor's base weights)
            fsdp_config=dict(param_offload=False, model_dtype=one_of("float32", DTYPE_CHOICES)),
        ),
        # on-policy distillation (verl's keys; hybridjax.algorithms.distillation): a frozen
        # teacher scores the student's sampled tokens in a `teacher` stage beside `ref` (on
        # placement.teacher's pool, with ref's packing and micro-batches) and the student
        # minimises the per-token reverse KL: loss_mode "reward" adds
        # −coef·(log π − log π_teacher) to each token's advantage (Thinking Machines' recipe),
        # "k1" / "k3" add coef·KL to the actor loss; use_policy_loss keeps the task reward's
        # advantage beside it (False: pure distillation)
        distillation=dict(
            enabled=False,
            loss_mode=one_of("reward", DISTILLATION_LOSS_MODES),
            distillation_loss_coef=at_least(1.0, 0),
            use_policy_loss=False,
            # teacher tokens kept per response position (B×R×topk log-probs and ids) for
            # loss_mode "forward_kl_topk" (its only reader; 0 = off, required >= 1 there)
            topk=at_least(0, 0),
            # HF checkpoint dir; "" = a random model of the actor's shape from trainer.seed
            # (with override_config's fields replaced: the same seed and shape = the student)
            # fsdp_config.param_offload: the teacher's weights in host memory while the rollout
            # runs (as ref.fsdp_config.param_offload does for the reference)
            teacher_model=dict(
                path="",
                override_config=ConfigDict(),
                fsdp_config=dict(param_offload=False),
            ),
        ),
        rollout=dict(
            name=one_of("hybridjax", ROLLOUT_NAMES, "the built-in paged engine"),
            n=positive(1),
            temperature=at_least(1.0, 0),
            top_k=-1,
            top_p=within(1.0, 0, 1, low_open=True),
            do_sample=True,
            # the distribution every trainer log-prob of the policy (old, current, the rollout
            # correction's) scores a sampled token under: "replay" the top-k/top-p support it
            # was drawn from (sampling-mask replay), "full" the whole vocabulary; "auto":
            # replay when sampling truncates (single-turn rollouts; hybridjax.training.build)
            log_prob_support=one_of("auto", LOG_PROB_SUPPORTS),
            prompt_length=512,
            response_length=512,
            # generation-layout dtype (update_weights casts to it); auto as model.dtype
            dtype=one_of("auto", DTYPE_CHOICES),
            gpu_memory_utilization=within(0.5, 0, 1, low_open=True),
            # release the KV pool and the generation weights after gen
            # (hybridjax.training.residency)
            free_cache_engine=True,
            num_pages=-1,  # -1: sized from gpu_memory_utilization
            page_size=positive(16),
            max_num_seqs=positive(256),  # running sequences per data-parallel replica (vLLM)
            log_prob_micro_batch_size_per_gpu=positive(16),
            log_prob_use_dynamic_bsz=False,  # the old-log-prob pass by token count
            log_prob_max_token_len_per_gpu=16384,
            ignore_eos=False,
            attention_impl=one_of("auto", ATTENTION_IMPLS),
            decode_steps_per_call=positive(32),
            min_prefill_bucket=positive(16),
            # KV pages as sequences grow, preempting the youngest when a pool runs out (vLLM),
            # or each sample's worst case reserved at admission (hybridjax.rollout.preemption)
            page_allocation=one_of("on_demand", PAGE_ALLOCATIONS),
            # tokens a replica computes per engine step: the running sequences' decode tokens
            # first, prompts in what is left, longer ones in chunks between decode calls
            # (verl/vLLM's keys; hybridjax.rollout.scheduler)
            max_num_batched_tokens=positive(8192),
            enable_chunked_prefill=True,
            # on demand: the fraction of a replica's KV pool a new group (or a preempted
            # sequence coming back) leaves free after its pages (vLLM's block manager watermark)
            watermark=within(0.01, 0, 1, high_open=True),
            # the engine records each prompt and generated token's experts (a MoE model) into
            # the batch's routed_experts, for actor.router_replay.mode="R3" (verl's key)
            enable_rollout_routing_replay=False,
            val_kwargs=dict(n=positive(1), temperature=0.0, top_k=-1, top_p=1.0, do_sample=False),
            # multi-turn rollouts with tools (hybridjax.rollout.agent_loop; verl's keys, plus
            # tool_timeout_s / tool_workers); response_length bounds model + tool tokens
            multi_turn=dict(
                enable=False,
                tool_config_path="",  # verl's tool config YAML (hybridjax.tools.config)
                format="hermes",  # tool-call format: <tool_call>{json}</tool_call>
                max_assistant_turns=5,
                max_parallel_calls=1,  # calls of one turn executed
                max_tool_response_length=256,  # characters of a tool response kept
                tool_response_truncate_side="middle",  # left | middle | right
                tool_timeout_s=30.0,  # per turn's calls
                tool_workers=8,  # threads running tools
            ),
        ),
    )
    c.critic = dict(
        enable=False,
        model=dict(
            path="",
            override_config=ConfigDict(),
            # LoRA as the actor's; the value head (`score`) is new and always trains in full
            lora_rank=0,
            lora_alpha=16.0,
            target_modules="all-linear",
            fsdp_config=dict(param_offload=False, optimizer_offload=False),
            use_remove_padding=True,
        ),
        ppo_mini_batch_size=positive(256),
        ppo_micro_batch_size_per_gpu=positive(8),
        use_dynamic_bsz=False,
        ppo_max_token_len_per_gpu=32768,
        forward_max_token_len_per_gpu=32768,
        use_prefix_sharing=True,
        ppo_epochs=positive(1),
        grad_clip=positive(1.0),
        cliprange_value=positive(0.5),
        loss_agg_mode=one_of("token-mean", LOSS_AGG_MODES),
        optim=_optim(1e-5),
    )
    c.reward_model = dict(
        enable=False,
        # dtype: its params and compute (auto as actor_rollout_ref.model.dtype)
        model=dict(
            path="",
            use_remove_padding=True,
            dtype=one_of("float32", DTYPE_CHOICES),
            # its weights in host memory except while it scores (`reward`)
            fsdp_config=dict(param_offload=False),
        ),
        micro_batch_size_per_gpu=16,
        use_dynamic_bsz=False,
        forward_max_token_len_per_gpu=32768,
        use_prefix_sharing=True,
        reward_manager=one_of("naive", REWARD_MANAGERS),  # hybridjax.rewards.manager
        on_error=one_of("zero", ON_ERROR_POLICIES),  # a reward function that fails on a row
        num_workers=positive(8),  # threads (built-ins) or worker processes (custom functions)
        # per call of a custom reward function in a worker process; 0 = none
        timeout_s=at_least(30.0, 0, "0: no limit"),
        # rule score with a reward model's: replace (model only) | sum
        combine=one_of("replace", COMBINE),
        # reward servers (python -m hybridjax.rewards.serve); urls comma-separated, "" = local
        remote=dict(
            urls="",
            timeout_s=positive(60.0),
            max_retries=at_least(2, 0),
            retry_backoff_s=at_least(0.5, 0),  # before the first retry, doubling after each
            concurrency=positive(4),
            batch_size=positive(32),
        ),
        # a generative reward model (LLM as judge, hybridjax.rewards.genrm): model.path is a
        # *ForCausalLM judge (with its own tokenizer) run by the paged engine, or remote.urls a
        # judge server (python -m hybridjax.rewards.serve --judge_path ...)
        generative=dict(
            enable=False,
            # fields {prompt} {response} {ground_truth}: decoded text
            prompt_template=DEFAULT_TEMPLATE,
            # verdict text -> score; a name, or parser_path/parser_name: fn(verdict) -> float
            parser=one_of("number", VERDICT_PARSERS.names),
            parser_path="",
            parser_name="parse_verdict",
            min_score=0.0,  # number/boxed: accepted range; yes_no: the scores of no/yes
            max_score=1.0,
            apply_chat_template=False,  # wrap the filled template as one user turn
            response_length=positive(16),  # verdict tokens at most
            prompt_length=positive(1024),  # judge prompt tokens at most
            temperature=at_least(0.0, 0, "0: greedy"),
            top_p=within(1.0, 0, 1, low_open=True),
            top_k=-1,
            max_num_seqs=positive(64),  # the judge engine's decode slots
            gpu_memory_utilization=within(0.2, 0, 1, low_open=True),  # its KV pool
            # release the judge's KV pool after each scoring batch (rebuilt at the next)
            free_cache_engine=True,
        ),
        # stop the run after this many consecutive steps in which most rows' rewards failed
        # (whatever on_error says); such steps are never checkpointed (hybridjax.rewards.guard)
        max_consecutive_failed_steps=positive(3),
        # DAPO soft overlong punishment on token_level_rewards (hybridjax.algorithms.overlong)
        overlong_buffer=dict(enable=False, len=at_least(0, 0), penalty_factor=at_least(1.0, 0)),
    )
    c.custom_reward_function = dict(path="", name="compute_score", reward_kwargs=ConfigDict())
    c.algorithm = dict(
        adv_estimator=one_of("gae", ADV_ESTIMATORS.names),
        gamma=within(1.0, 0, 1),
        lam=within(1.0, 0, 1),
        norm_adv_by_std_in_grpo=True,
        use_kl_in_reward=False,
        kl_penalty=one_of("kl", KL_TYPES),
        kl_ctrl=_kl_ctrl(KLControlConfig()),  # fixed, 0.001, target 0.1, horizon 1e4
        # rollout/trainer mismatch (hybridjax.algorithms.rollout_correction); 0.0 = not set
        rollout_is=False,  # apply the weights to the policy loss (else metrics only)
        # upper bound; 0 = no importance weights at all
        rollout_is_threshold=at_least(0.0, 0, "0: off"),
        rollout_is_threshold_lower=at_least(0.0, 0, "0: 1/upper"),  # 0 = 1 / rollout_is_threshold
        rollout_is_level=one_of("token", ROLLOUT_IS_LEVELS),
        rollout_is_mode=one_of("truncate", ROLLOUT_IS_MODES),
        # drop a response with a token ratio below; 0 = off
        rollout_is_veto_threshold=at_least(0.0, 0, "0: off"),
        # a mismatch mask by name (hybridjax.algorithms.rollout_correction; "" = off):
        # icepop, sequence_mask (TRL's default), off_policy_sequence_mask (DeepSeek-V3.2)
        rollout_rs=one_of("", lambda: ("", *ROLLOUT_REJECTIONS.names())),
        rollout_rs_threshold=at_least(0.0, 0, "0: the entry's default"),  # upper bound / δ
        rollout_rs_threshold_lower=at_least(0.0, 0, "0: the entry's default"),
        # DAPO dynamic sampling (hybridjax.rl.dynamic_sampling): drop groups whose metric
        # has no spread, generate more until data.train_batch_size groups; 0 = no cap
        filter_groups=dict(enable=False, metric="acc", max_num_gen_batches=0),
    )
    # verl's default_local_dir is checkpoints/${project_name}/${experiment_name}: naming a run
    # also names its directory, unless a config sets default_local_dir itself
    project_name, experiment_name = FieldReference("hybridjax"), FieldReference("run")
    c.trainer = dict(
        project_name=project_name,  # wandb project; names the run directory (below)
        experiment_name=experiment_name,  # wandb run, TensorBoard run, run directory
        # also "wandb" (pip install -e '.[wandb]')
        logger=subset_of(("console", "jsonl", "tensorboard"), LOGGERS),
        log_val_generations=at_least(0, 0),  # K (prompt, response, score) samples per validation
        log_train_generations=at_least(0, 0),  # K samples of the training rollout, every step
        total_epochs=positive(1),
        total_training_steps=positive_or_unset(-1),  # -1: total_epochs × batches per epoch
        seed=0,
        save_freq=positive_or_unset(-1),  # -1: only at the end and on SIGTERM/SIGINT
        test_freq=positive_or_unset(-1),  # -1: no periodic validation
        val_before_train=False,
        critic_warmup=at_least(0, 0),
        default_local_dir=FieldReference("checkpoints/") + project_name + "/" + experiment_name,
        resume_mode="auto",  # auto | disable | a checkpoint path
        max_actor_ckpt_to_keep=positive(2),
        max_consecutive_nan_steps=positive(3),
        peak_flops=at_least(0.0, 0),  # per device, FLOP/s; 0 = measure a matmul at start
        progress_bar=True,
        # sync: generate, then train; one_step_off: batch k+1 is generated (with the weights
        # of step k-1) while step k trains; async: up to staleness_threshold batches ahead.
        # Both need the rollout on its own pool (hybridjax.rl.async_rollout)
        rollout_mode=one_of("sync", ROLLOUT_MODES),
        staleness_threshold=at_least(1, 0),  # async only: policy versions a sample may lag
        # async only: generations running when a batch is full carry over to the next one and
        # continue under the new weights (verl's async_training.partial_rollout); the bound
        # then applies per token (hybridjax.rl.partial_rollout)
        partial_rollout=False,
        # what carried sequences keep at a weight swap: "recompute" (their tokens prefilled
        # again with the new weights: exact) or "keep" (the keys/values the old weights
        # computed stay: no prefill, the rollout IS weights correct the mismatch)
        partial_rollout_kv=one_of("recompute", PARTIAL_ROLLOUT_KV),
        # plan per-device memory of every stage before building anything (hybridjax.plan);
        # a config that does not fit is a config error
        check_memory=False,
        # fraction of each GPU JAX's allocator takes (hybridjax.allocator); set before JAX
        # starts, XLA_PYTHON_CLIENT_MEM_FRACTION in the environment wins; CPU ignores it
        device_memory_fraction=within(0.9, 0, 1, low_open=True),
        # JAX's persistent compilation cache (hybridjax.compilation_cache): auto = jax/ under
        # the user's cache directory on GPU/TPU (off on CPU), "" = off, or a path;
        # JAX_COMPILATION_CACHE_DIR wins
        compilation_cache_dir="auto",
        # edits of the default step (hybridjax.rl.pipeline): "after <stage>: <file.py or
        # module>:<function>" (or before / replace), or "remove <stage>"
        stages=(),
        # several processes under jax.distributed (hybridjax.sharding.hosts.DistributedConfig)
        distributed=dict(
            enable="auto",  # auto | on | off
            coordinator_address="",  # host:port of process 0; "" = auto-detect
            num_processes=0,  # 0 = auto-detect
            process_id=-1,  # -1 = auto-detect
            heartbeat_timeout_s=30,  # a silent peer ends the others' runs after this long
            initialization_timeout_s=300,
        ),
    )
    c.mesh = dict(
        train=dict(
            # training mesh ("data", "expert", "fsdp", "tensor"); sizes multiply to the devices,
            # one of them may be -1 (the rest). Default: verl's FSDP, parameters, gradients and
            # optimizer states sharded over every device (fsdp=-1); data=-1 fsdp=1 replicates
            data=1,
            # expert parallelism of a MoE model: experts split num_experts/expert per device
            # (must divide num_experts; > 1 needs a MoE model); its ranks split the batch like
            # data, so batch rows split over data × expert × fsdp (docs/model-families.md)
            expert=positive(1),
            fsdp=-1,
            tensor=1,
        ),
        generate=dict(data=-1, tensor=1),
    )
    # verl's resource pools: name -> n_devices (-1 = the rest) and optional train / generate
    # mesh shapes (default mesh.*); pools take consecutive devices in the order of their names
    # (hybridjax.sharding.pools)
    c.resource_pool = dict(global_pool=dict(n_devices=-1))
    c.placement = dict(
        actor="global_pool",
        rollout="global_pool",
        ref="global_pool",
        critic="global_pool",
        reward_model="global_pool",
        teacher="",  # the distillation teacher's pool; "" = placement.ref's
    )
    return c
