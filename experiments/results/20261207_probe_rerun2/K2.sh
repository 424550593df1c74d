#!/bin/bash
cd /tmp/pr2
out() { echo "== $1 rc=$2"; grep -v "^\s*$" /tmp/pr2/k/$1.log | grep -v -i "E0000\|W0000\|it/s\]" | tail -${3:-2} | cut -c1-300; }
# K16: resume a run at step 2 with total_training_steps=1 (fewer than done)
STEPS=1 ./T.sh /tmp/pr2/run1 > k/K16.log 2>&1; out K16 $?
# K17: every checkpoint unreadable, in new ways: global_step_2 a regular file, global_step_1 an empty dir, global_step_3 a dangling link
rm -rf k/bad && mkdir -p k/bad/global_step_1 && echo x > k/bad/global_step_2 && ln -s /nonexistent k/bad/global_step_3
STEPS=4 ./T.sh /tmp/pr2/k/bad > k/K17.log 2>&1; out K17 $? 3; ls k/bad
# K23: disk full while exporting (a 2 MB tmpfs)
mkdir -p /tmp/pr2_full && unshare --mount --propagation private sh -c 'mount -t tmpfs -o size=2m tmpfs /tmp/pr2_full && /tmp/pr2/E.sh /tmp/pr2_full/hf > /tmp/pr2/k/K23.log 2>&1; echo "rc=$?" >> /tmp/pr2/k/K23.log; ls -a /tmp/pr2_full >> /tmp/pr2/k/K23.log'; tail -4 k/K23.log | cut -c1-300
