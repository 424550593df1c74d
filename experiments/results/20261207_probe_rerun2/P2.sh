#!/bin/bash
# after the fixes: P11 (the finished 4-step run resumed to 6) and P10 (two SIGINTs)
cd /tmp/pr2
wait_for() { for i in $(seq 1 300); do grep -q "$1" $2 2>/dev/null && return 0; sleep 1; done; return 1; }
rm -rf p/run3 p/.run3.lock
STEPS=6 ./TP.sh /tmp/pr2/p/run3 --config.trainer.resume_mode=/tmp/pr2/p/run/global_step_4 --config.actor_rollout_ref.rollout.max_num_seqs=2 > p/P11after.log 2>&1; echo "== P11after rc=$?"; grep -E "resumed|^step|step [0-9] \||Error" p/P11after.log | sed 's/.*\(step [0-9]* |\)/\1/' | cut -c1-120; ls p/run3 | tr '\n' ' '; echo
STEPS=8 ./TP.sh /tmp/pr2/p/run3 > p/P10after.log 2>&1 & pid=$!
wait_for "step 7 |" p/P10after.log; sleep 1
tp=$(pgrep -f "default_local_dir=/tmp/pr2/p/run3" | tail -1)
kill -INT $tp; sleep 0.3; kill -INT $tp; wait $pid; echo "== P10after rc=$?"
grep -v "^\s*$" p/P10after.log | grep -v "it/s\]" | tail -4 | cut -c1-200; echo "tracebacks: $(grep -c Traceback p/P10after.log)"; ls p/run3 | tr '\n' ' '
