#!/bin/bash
# tiny quickstart trainer: T.sh RUNDIR [extra args]
d=$1; shift
cd /tmp/pr3 && XLA_FLAGS=--xla_force_host_platform_device_count=2 exec nice -n 19 timeout ${TMO:-240} env PYTHONPATH=${PP:-/work/wt/k22probe} /work/main/.venv/bin/python -m hybridjax.train --config=/tmp/pr3/prcfg.py --config.trainer.total_training_steps=${STEPS:-2} --config.trainer.save_freq=1 --config.trainer.val_before_train=False --config.trainer.test_freq=-1 --config.data.train_batch_size=4 --config.actor_rollout_ref.rollout.n=2 --config.actor_rollout_ref.actor.ppo_mini_batch_size=4 --config.actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8 --config.actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=8 --config.trainer.resume_mode=auto --config.trainer.default_local_dir=$d "$@"
