#!/bin/bash
# new export cases; each line: case id, command, exit code, last 2 lines of output
cd /tmp/pr2
R=/tmp/pr2/run1
out() { echo "== $1 rc=$2"; grep -v "^\s*$" /tmp/pr2/x/$1.log | grep -v -i "warning: all log\|E0000\|W0000" | tail -${3:-2}; }
c() { id=$1; shift; "$@" > /tmp/pr2/x/$id.log 2>&1; out $id $?; }
# X7 '.' from the run's parent
c X7 env CWD=/tmp/pr2 ./E.sh . --overwrite
# X8 '.' from inside the run dir
c X8 env CWD=/tmp/pr2/run1 ./E.sh . --overwrite
# X9 '..' from run1/logs
c X9 env CWD=/tmp/pr2/run1/logs ./E.sh .. --overwrite
# X10 relative spelling into a checkpoint
c X10 env CWD=/tmp/pr2 ./E.sh run1/logs/../global_step_2/./hf
# X11 target = the shipped model path
c X11 ./E.sh /work/wt/probe2/hybridjax/assets/quickstart --overwrite
# X16 a new directory inside the run directory
c X16 ./E.sh /tmp/pr2/run1/hf
ls -a /tmp/pr2/run1
# X15 parent is a file; a path under /proc
echo hi > /tmp/pr2/afile
c X15a ./E.sh /tmp/pr2/afile/sub
c X15b ./E.sh /proc/hf_export
# X14 odd names in an earlier export
c X14pre ./E.sh /tmp/pr2/exp_odd
touch "/tmp/pr2/exp_odd/a
b" "/tmp/pr2/exp_odd/$(printf 'bad\xff')"
c X14 ./E.sh /tmp/pr2/exp_odd --overwrite 3
ls /tmp/pr2/exp_odd | od -c | head -3
