#!/bin/bash
# reward-function cases (each a 1-step tiny run): K3.sh
cd /tmp/pr3
out() { echo "== $1 rc=$2 ${3}s"; grep -v "^\s*$" /tmp/pr3/k/$1.log | grep -v -i "E0000\|W0000\|it/s\]" | tail -${N:-2} | cut -c1-400; }
c() { id=$1; shift; rm -rf /tmp/pr3/k/run_$id; s=$(date +%s); STEPS=1 ./T.sh /tmp/pr3/k/run_$id "$@" > k/$id.log 2>&1; rc=$?; out $id $rc $(( $(date +%s) - s )); }
left() { sleep 3; echo "   left running: $(ps -eo pid,args | grep -E 'rf3.py|forkserver' | grep -v grep | wc -l) processes; daemon files: $(ls k | grep -c daemon_)"; }
F=--config.custom_reward_function
mkdir -p k/rw && cp rf3.py loud.py k/rw/
rm -f k/daemon_*
c K38 $F.path=/tmp/pr3/k/rw/rf3.py $F.name=daemon2; left
for f in k/daemon_*; do p=${f##*_}; [ -e /proc/$p ] && echo "   daemon $p ALIVE: $(cat /proc/$p/stat | cut -d' ' -f3)" || echo "   daemon $p gone"; done
rm -f k/daemon_*
c K33 $F.path=/tmp/pr3/k/rw/rf3.py $F.name=deaf_daemon; left
for f in k/daemon_*; do p=${f##*_}; [ -e /proc/$p ] && echo "   daemon $p ALIVE" || echo "   daemon $p gone"; done
N=3 c K31 $F.path=/tmp/pr3/k/rw/rf3.py $F.name=array1
s=$(date +%s); c K32 $F.path=/tmp/pr3/k/rw/rf3.py $F.name=thread_forever; left
c K35 $F.path=/tmp/pr3/k/rw/rf3.py $F.name=Scorer
c K34 $F.path=/tmp/pr3/k/rw/loud.py; echo "   log bytes: $(wc -c < k/K34.log)"
c K39 $F.path=/tmp/pr3/k/rw/rf3.py $F.name=hold_stdout; left
