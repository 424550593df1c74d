#!/bin/bash
# partial-rollout resume cases
cd /tmp/pr2
R=/tmp/pr2/p/run
rm -rf $R /tmp/pr2/p/.run.lock
wait_for() { for i in $(seq 1 300); do grep -q "$1" $2 2>/dev/null && return 0; sleep 1; done; return 1; }
summ() { echo "== $1 rc=$2"; grep -v "^\s*$" p/$1.log | grep -E "error|Error|Traceback|resumed|stopped|no steps|in flight|WARNING|NOTICE|exported|^step|step [0-9]+ \|" | sed 's/.*\(step [0-9]* |\)/\1/' | cut -c1-220 | tail -${3:-6}; ls $R | tr '\n' ' '; echo; }
# P7: SIGKILL in the middle of step 2 (after step 1's line), then the same command
STEPS=4 ./TP.sh $R > p/P7a.log 2>&1 & pid=$!
wait_for "step 1 |" p/P7a.log; sleep 4; pkill -9 -P $pid; kill -9 $pid 2>/dev/null; wait $pid; summ P7a $?
STEPS=4 ./TP.sh $R > p/P7b.log 2>&1; summ P7b $?
# P11: resume to 6 with a smaller engine (max_num_seqs 4 -> 2)
STEPS=6 ./TP.sh $R --config.actor_rollout_ref.rollout.max_num_seqs=2 > p/P11.log 2>&1; summ P11 $?
# P8: resume to 8 with staleness_threshold 1 -> 0
STEPS=8 ./TP.sh $R --config.trainer.staleness_threshold=0 > p/P8.log 2>&1; summ P8 $?
# P9: resume to 9 in sync mode (rollout_mode=sync, one pool)
STEPS=9 ./TP.sh $R --config.trainer.rollout_mode=sync > p/P9.log 2>&1; summ P9 $?
# P10: two SIGINTs in a row during step 10 of 11
STEPS=11 ./TP.sh $R > p/P10.log 2>&1 & pid=$!
wait_for "resumed" p/P10.log; wait_for "step 10 |" p/P10.log; sleep 1
tp=$(pgrep -P $(pgrep -P $pid) -f hybridjax.train | head -1); [ -z "$tp" ] && tp=$(pgrep -f "default_local_dir=$R" | tail -1)
kill -INT $tp; sleep 0.3; kill -INT $tp; wait $pid; summ P10 $? 10
echo "tracebacks in P10: $(grep -c Traceback p/P10.log)"
echo "left processes:"; ps -eo pid,args | grep -E "default_local_dir=$R|forkserver" | grep -v grep | cut -c1-120
