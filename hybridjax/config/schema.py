"""The full RL trainer configuration: every key, its default, and verl's name for it.

`base_config()` is the schema: a config file starts from it and changes values, and
`hybridjax.config.checks` rejects any key that is not here. Key names follow verl's
`ppo_trainer.yaml` (`data.*`, `actor_rollout_ref.{model,actor,ref,rollout}.*`, `critic.*`,
`reward_model.*`, `custom_reward_function.*`, `algorithm.*`, `trainer.*`), plus `mesh.*` for the
two device layouts of the hybrid engine and `resource_pool.*` / `placement.*` for the device
pools of the roles. Empty strings mean "not set" (ConfigDict fields keep
their type, so `None` defaults would break `--config.a.b=x` overrides).
"""

from __future__ import annotations

import dataclasses

from ml_collections import ConfigDict, FieldReference

from hybridjax.algorithms.config import KLControlConfig


def _optim(lr: float) -> ConfigDict:
    return ConfigDict(
        dict(
            lr=lr,
            lr_warmup_steps=-1,  # -1: use lr_warmup_steps_ratio
            lr_warmup_steps_ratio=0.0,
            warmup_style="constant",  # constant | cosine
            min_lr_ratio=0.0,
            weight_decay=0.01,
            betas=(0.9, 0.999),
            total_training_steps=-1,  # -1: filled from the trainer's step count
        )
    )


def base_config() -> ConfigDict:
    """Every trainer key with its default (verl's defaults where verl has the key)."""
    c = ConfigDict()
    c.data = dict(
        train_files="",
        val_files="",
        tokenizer="",  # tokenizer.json path; "" = the model path's tokenizer
        prompt_key="prompt",
        max_prompt_length=512,
        max_response_length=512,
        train_batch_size=1024,
        val_batch_size=-1,  # -1: the whole validation set in batches of train_batch_size
        truncation="error",
        filter_overlong_prompts=False,
        # message text that spells a special token (`<|im_end|>`): keep (as transformers: it
        # becomes that token) | escape (tokenised as plain text) | error; rows counted at load
        special_tokens_in_content="keep",
        shuffle=True,
        seed=1,
        val_max_samples=-1,  # -1: every validation row
    )
    c.actor_rollout_ref = dict(
        model=dict(
            path="",  # HF checkpoint dir; "" = random init from override_config
            override_config=ConfigDict(),  # ModelConfig fields that replace config.json's
            enable_gradient_checkpointing=False,
            dtype="float32",  # compute dtype of training matmuls
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
        ),
        actor=dict(
            ppo_mini_batch_size=256,  # in prompts; × rollout.n responses
            ppo_micro_batch_size_per_gpu=8,  # in responses, per data-parallel shard
            ppo_epochs=1,
            shuffle=False,
            # micro-batches by token count (per device) instead of ppo_micro_batch_size_per_gpu
            use_dynamic_bsz=False,
            ppo_max_token_len_per_gpu=16384,
            use_prefix_sharing=True,  # the responses of a prompt share one copy of it
            # the separate old-log-prob pass: "auto" skips it when the update is on-policy (one
            # epoch, one mini-batch, nothing needs π_old before the update), "true" always runs
            # it, "false" never (rejected unless on-policy); see build.recompute_old_log_prob
            recompute_old_log_prob="auto",
            grad_clip=1.0,
            clip_ratio=0.2,
            clip_ratio_low=0.0,  # 0: follow clip_ratio (verl's null)
            clip_ratio_high=0.0,  # 0: follow clip_ratio
            clip_ratio_c=3.0,
            loss_agg_mode="token-mean",
            loss_scale_factor=0.0,  # seq-mean-token-sum-norm divisor; 0 = response length
            policy_loss=dict(loss_mode="vanilla"),
            entropy_coeff=0.0,
            # without use_fused_kernels: the entropy recomputed in the backward (no softmax
            # kept) and computed over chunks of positions (verl's keys)
            entropy_checkpointing=True,
            entropy_from_logits_with_chunking=True,
            use_kl_loss=False,
            kl_loss_coef=0.001,
            kl_loss_type="low_var_kl",
            optim=_optim(1e-6),
            # host memory while the rollout runs (verl's keys)
            fsdp_config=dict(param_offload=False, optimizer_offload=False),
        ),
        ref=dict(
            log_prob_micro_batch_size_per_gpu=16,
            log_prob_use_dynamic_bsz=False,
            log_prob_max_token_len_per_gpu=16384,
            use_prefix_sharing=True,
            # model_dtype: the frozen copy's parameter dtype (bfloat16 halves it; not with LoRA,
            # whose reference is the actor's base weights)
            fsdp_config=dict(param_offload=False, model_dtype="float32"),
        ),
        rollout=dict(
            name="hybridjax",
            n=1,
            temperature=1.0,
            top_k=-1,
            top_p=1.0,
            do_sample=True,
            prompt_length=512,
            response_length=512,
            dtype="float32",  # generation-layout dtype (update_weights casts to it)
            gpu_memory_utilization=0.5,
            # release the KV pool and the generation weights after gen (hybridjax.rl.residency)
            free_cache_engine=True,
            num_pages=-1,  # -1: sized from gpu_memory_utilization
            page_size=16,
            max_num_seqs=256,
            log_prob_micro_batch_size_per_gpu=16,
            log_prob_use_dynamic_bsz=False,  # the old-log-prob pass by token count
            log_prob_max_token_len_per_gpu=16384,
            ignore_eos=False,
            attention_impl="auto",  # auto | jnp | pallas
            decode_steps_per_call=32,
            min_prefill_bucket=16,
            val_kwargs=dict(n=1, temperature=0.0, top_k=-1, top_p=1.0, do_sample=False),
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
        ppo_mini_batch_size=256,
        ppo_micro_batch_size_per_gpu=8,
        use_dynamic_bsz=False,
        ppo_max_token_len_per_gpu=32768,
        forward_max_token_len_per_gpu=32768,
        use_prefix_sharing=True,
        ppo_epochs=1,
        grad_clip=1.0,
        cliprange_value=0.5,
        loss_agg_mode="token-mean",
        optim=_optim(1e-5),
    )
    c.reward_model = dict(
        enable=False,
        model=dict(path="", use_remove_padding=True, dtype="float32"),  # dtype: its params
        micro_batch_size_per_gpu=16,
        use_dynamic_bsz=False,
        forward_max_token_len_per_gpu=32768,
        use_prefix_sharing=True,
        reward_manager="naive",  # naive | batch | dapo | prime (hybridjax.rewards.manager)
        on_error="zero",  # a reward function that fails on a row: zero | raise
        num_workers=8,  # threads (built-ins) or worker processes (custom functions)
        timeout_s=30.0,  # per call of a custom reward function in a worker process; 0 = none
        combine="replace",  # rule score with a reward model's: replace (model only) | sum
        # reward servers (python -m hybridjax.rewards.serve); urls comma-separated, "" = local
        remote=dict(
            urls="",
            timeout_s=60.0,
            max_retries=2,
            retry_backoff_s=0.5,  # before the first retry, doubling after each
            concurrency=4,
            batch_size=32,
        ),
        # stop the run after this many consecutive steps in which most rows' rewards failed
        # (whatever on_error says); such steps are never checkpointed (hybridjax.rewards.guard)
        max_consecutive_failed_steps=3,
        # DAPO soft overlong punishment on token_level_rewards (hybridjax.algorithms.overlong)
        overlong_buffer=dict(enable=False, len=0, penalty_factor=1.0),
    )
    c.custom_reward_function = dict(path="", name="compute_score", reward_kwargs=ConfigDict())
    c.algorithm = dict(
        adv_estimator="gae",
        gamma=1.0,
        lam=1.0,
        norm_adv_by_std_in_grpo=True,
        use_kl_in_reward=False,
        kl_penalty="kl",
        kl_ctrl=dataclasses.asdict(KLControlConfig()),  # fixed, 0.001, target 0.1, horizon 1e4
        # rollout/trainer mismatch (hybridjax.algorithms.rollout_correction); 0.0 = not set
        rollout_is=False,  # apply the weights to the policy loss (else metrics only)
        rollout_is_threshold=0.0,  # upper bound; 0 = no importance weights at all
        rollout_is_threshold_lower=0.0,  # 0 = 1 / rollout_is_threshold
        rollout_is_level="token",  # token | sequence | geometric
        rollout_is_mode="truncate",  # truncate | mask
        rollout_is_veto_threshold=0.0,  # drop a response with a token ratio below; 0 = off
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
        logger=("console", "jsonl", "tensorboard"),  # also "wandb" (pip install -e '.[wandb]')
        log_val_generations=0,  # K (prompt, response, score) samples per validation
        log_train_generations=0,  # K samples of the training rollout, every step
        total_epochs=1,
        total_training_steps=-1,  # -1: total_epochs × batches per epoch
        seed=0,
        save_freq=-1,  # -1: only at the end and on SIGTERM/SIGINT
        test_freq=-1,  # -1: no periodic validation
        val_before_train=False,
        critic_warmup=0,
        default_local_dir=FieldReference("checkpoints/") + project_name + "/" + experiment_name,
        resume_mode="auto",  # auto | disable | a checkpoint path
        max_actor_ckpt_to_keep=2,
        max_consecutive_nan_steps=3,
        peak_flops=0.0,  # per device, FLOP/s; 0 = measure a matmul at start
        progress_bar=True,
        # sync: generate, then train; one_step_off: batch k+1 is generated (with the weights
        # of step k-1) while step k trains; async: up to staleness_threshold batches ahead.
        # Both need the rollout on its own pool (hybridjax.rl.async_rollout)
        rollout_mode="sync",
        staleness_threshold=1,  # async only: policy versions a sample may lag
        # plan per-device memory of every stage before building anything (hybridjax.plan);
        # a config that does not fit is a config error
        check_memory=False,
        # fraction of each GPU JAX's allocator takes (hybridjax.allocator); set before JAX
        # starts, XLA_PYTHON_CLIENT_MEM_FRACTION in the environment wins; CPU ignores it
        device_memory_fraction=0.9,
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
        train=dict(data=-1, fsdp=1, tensor=1),
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
    )
    return c
