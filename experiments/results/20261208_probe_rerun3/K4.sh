#!/bin/bash
# config and checkpoint cases K24-K30, K36, K37, K40-K42 (each refused at start, or a 1-step run)
cd /tmp/pr3
out() { echo "== $1 rc=$2 ${3}s"; grep -v "^\s*$" /tmp/pr3/k/$1.log | grep -v -i "E0000\|W0000\|it/s\]" | tail -${N:-2} | cut -c1-400; }
c() { id=$1; shift; s=$(date +%s); STEPS=${STEPS:-1} TMO=${TMO:-200} ./T.sh ${RUN:-/tmp/pr3/k/run_$id} "$@" > k/$id.log 2>&1; rc=$?; out $id $rc $(( $(date +%s) - s )); }
T=--config.trainer
c K24 $T.total_training_steps=-1
c K25 --config.data.train_files=/nonexistent/train.parquet
c K26 $T.default_local_dir=/proc/hybridjax_run
mkdir -p k/emptymodel; c K27 --config.actor_rollout_ref.model.path=/tmp/pr3/k/emptymodel
c K29 $T.resume_mode=resume_path
RUN=/tmp/pr3/k/run_K30 c K30 $T.resume_mode=/tmp/pr3/run1/global_step_99
c K36 --config.custom_reward_function.path=/tmp/pr3/k
c K37 --confg.trainer.total_training_steps=1
# K40: resume the finished 2-step run1 (copied) with LoRA on (a checkpoint without adapters)
rm -rf k/run_K40 && cp -r run1 k/run_K40 && rm -f k/run_K40/.*.lock
RUN=/tmp/pr3/k/run_K40 STEPS=3 N=3 c K40 --config.actor_rollout_ref.model.lora_rank=8
# K41: resume run1 (copied) with a different rollout.n and train_batch_size
rm -rf k/run_K41 && cp -r run1 k/run_K41 && rm -f k/run_K41/.*.lock
RUN=/tmp/pr3/k/run_K41 STEPS=3 N=3 c K41 --config.data.train_batch_size=8 --config.actor_rollout_ref.actor.ppo_mini_batch_size=8
# K42: the checkpoint's metadata file made unreadable (truncated to 0 bytes) in every step
rm -rf k/run_K42 && cp -r run1 k/run_K42 && find k/run_K42 -name "_CHECKPOINT_METADATA" -exec truncate -s 0 {} \;
RUN=/tmp/pr3/k/run_K42 STEPS=3 N=3 c K42
ls k/run_K42
