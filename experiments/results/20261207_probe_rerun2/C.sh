#!/bin/bash
# class_name cases: C.sh ID CLASS ; cwd /tmp/pr2/tc (PYTHONPATH = checkout only)
cd /tmp/pr2
out() { echo "== $1 rc=$2"; grep -v "^\s*$" /tmp/pr2/k/$1.log | grep -v -i "E0000\|W0000" | tail -${3:-2}; }
c() { id=$1; cls=$2; sed "s|CLASS|$cls|" tc/tool.yaml.in > tc/$id.yaml; rm -f tc/SIDE_EFFECT
  CWD=/tmp/pr2/tc STEPS=1 ./T.sh /tmp/pr2/k/run_$id --config.actor_rollout_ref.rollout.multi_turn.enable=True --config.actor_rollout_ref.rollout.multi_turn.tool_config_path=/tmp/pr2/tc/$id.yaml > k/$id.log 2>&1; out $id $?; [ -e tc/SIDE_EFFECT ] && echo "   SIDE EFFECT: mod imported"; }
c C6 "hybridjax.train.flags"
c C7 "hybridjax.tools.Tool"
c C8 "hybridjax.tools.sandbox:PythonTool"
c C9 "__main__.RLTrainer"
c C10 "mod_side.Thing"
c C11 "setuptools.Command"
c C12 "hybridjax.tools.base.Tool"
c C13 "hybridjax.rl.trainer.RLTrainer"
c C14 "'  python  '"
c C15 "json.decoder.JSONDecoder"
c C16 "hybridjax.tools.sandbox.PythonTool.__init__"
