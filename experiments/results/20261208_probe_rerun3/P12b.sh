cd /tmp/pr3
out() { echo "== $1 rc=$2 ${3}s"; grep -v "^\s*$" /tmp/pr3/p/$1.log | grep -v -i "E0000\|W0000\|it/s\]" | grep -i "error\|warn\|resum\|step\|in flight\|Traceback\|no steps" | tail -${N:-3} | cut -c1-300; }
c() { id=$1; run=$2; shift 2; s=$(date +%s); TMO=400 ./TP.sh $run "$@" > p/$id.log 2>&1; rc=$?; out $id $rc $(( $(date +%s) - s )); }
rm -rf p/r12b; sleep 1; rm -rf p/r12b && cp -r p/base p/r12b && rm -rf p/r12b/global_step_2 && STEPS=2 N=6 c P12b /tmp/pr3/p/r12b --config.actor_rollout_ref.rollout.n=4
