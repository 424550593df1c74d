#!/bin/bash
# partial-rollout resume cases P12-P14 (TP.sh: two 1-device pools, async, staleness 1, partial_rollout)
cd /tmp/pr3
out() { echo "== $1 rc=$2 ${3}s"; grep -v "^\s*$" /tmp/pr3/p/$1.log | grep -v -i "E0000\|W0000\|it/s\]" | grep -i "error\|warn\|resum\|step\|in flight\|Traceback\|no steps" | tail -${N:-3} | cut -c1-300; }
c() { id=$1; run=$2; shift 2; s=$(date +%s); ./TP.sh $run "$@" > p/$id.log 2>&1; rc=$?; out $id $rc $(( $(date +%s) - s )); }
rm -rf p/base && STEPS=2 c P0 /tmp/pr3/p/base
# P12: resume with rollout.n=4 (the prompts in flight were sampled for n=2)
rm -rf p/r12 && cp -r p/base p/r12 && STEPS=3 c P12 /tmp/pr3/p/r12 --config.actor_rollout_ref.rollout.n=4 --config.actor_rollout_ref.actor.ppo_mini_batch_size=4
# P13: resume with max_num_seqs=8 and staleness_threshold=2
rm -rf p/r13 && cp -r p/base p/r13 && STEPS=3 c P13 /tmp/pr3/p/r13 --config.actor_rollout_ref.rollout.max_num_seqs=8 --config.trainer.staleness_threshold=2
# P14: resume with a different data.seed / shuffle off (the saved data order)
rm -rf p/r14 && cp -r p/base p/r14 && STEPS=3 c P14 /tmp/pr3/p/r14 --config.data.shuffle=False
# P12b: resume from global_step_1 (prompts in flight for step 2 saved) with rollout.n=4
rm -rf p/r12b && cp -r p/base p/r12b && rm -rf p/r12b/global_step_2 && STEPS=2 N=6 c P12b /tmp/pr3/p/r12b --config.actor_rollout_ref.rollout.n=4
