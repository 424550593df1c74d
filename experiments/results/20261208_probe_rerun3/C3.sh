#!/bin/bash
# class_name cases C17-C22: C3.sh ; cwd /tmp/pr3/tc holding side3.py (writes SIDE_EFFECT at import)
cd /tmp/pr3
out() { echo "== $1 rc=$2"; grep -v "^\s*$" /tmp/pr3/c/$1.log | grep -v -i "E0000\|W0000" | tail -${N:-2} | cut -c1-400; }
c() { id=$1; cls=$2; sed "s|CLASS|$cls|" tc/tool.yaml.in > tc/$id.yaml; rm -f tc/SIDE_EFFECT
  CWD=/tmp/pr3/tc STEPS=1 TMO=120 ./T.sh /tmp/pr3/c/run_$id --config.actor_rollout_ref.rollout.multi_turn.enable=True --config.actor_rollout_ref.rollout.multi_turn.tool_config_path=/tmp/pr3/tc/$id.yaml > c/$id.log 2>&1; out $id $?; [ -e tc/SIDE_EFFECT ] && echo "   SIDE EFFECT: side3 imported"; }
c C17 "'hybridjax.tools.calculator.CalculatorTool\t'"
c C18 "hybridjax.t$(printf '\xd0\xbe')ols.calculator.CalculatorTool"
c C19 "os.system"
c C20 "builtins.object"
PP=:/work/wt/k22probe c C21 "side3.Thing"
PP=/work/wt/k22probe:. c C21b "side3.Thing"
c C22 "hybridjax.tools.calculator"
c C23 "hybridjax.tools.calculator.CalculatorTool.__class__"
