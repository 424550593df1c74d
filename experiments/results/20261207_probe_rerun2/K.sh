#!/bin/bash
cd /tmp/pr2
out() { echo "== $1 rc=$2"; grep -v "^\s*$" /tmp/pr2/k/$1.log | grep -v -i "E0000\|W0000\|step [0-9]*/\|it/s\]" | tail -${3:-2}; }
c() { id=$1; shift; rm -rf /tmp/pr2/k/run_$id; STEPS=${STEPS:-1} ./T.sh /tmp/pr2/k/run_$id "$@" > k/$id.log 2>&1; out $id $? ${N:-2}; }
M=--config.actor_rollout_ref.model.path
R=--config.actor_rollout_ref.rollout
c K11 $M=/tmp/pr2/k/eos_str
c K12 $M=/tmp/pr2/k/eos_list
c K13 $M=/tmp/pr2/k/eos_neg
c K13b $M=/tmp/pr2/k/eos_float
N=4 c K14 $R.temperature=1e-30
N=4 c K15 $R.top_k=1
c K18a $R.decode_steps_per_call=0
c K18b $R.decode_steps_per_call=1000000000000
c K18c $R.decode_steps_per_call=2.5
c K19a $R.page_size=0
c K19b $R.page_size=1000000000
c K20a $R.gpu_memory_utilization=1e-9
c K20b $R.num_pages=1
c K21a "--config.trainer.stages=('after reward: /tmp/pr2/k/stg.py:f',)"
c K21b "--config.trainer.stages=('after nosuchstage: configs/stages/banned_filter.py:zero_banned',)"
c K21c "--config.trainer.stages=('sideways reward: x:y',)"
c K21d "--config.trainer.stages=('after reward: /tmp/pr2/k:f',)"
F=--config.custom_reward_function
for fn in exit0 killself sysexit_str close_stdio daemon; do N=3 c K22_$fn $F.path=/tmp/pr2/k/rw/rf.py $F.name=$fn --config.reward_model.timeout_s=5; done
N=3 c K22_batch_exit $F.path=/tmp/pr2/k/rw/rf.py $F.name=batch_exit --config.reward_model.reward_manager=batch
echo "daemons left:"; ps -eo pid,etime,args | grep -E "rf.py|forkserver" | grep -v grep | head
