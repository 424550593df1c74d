#!/bin/bash
# export cases (X19-X28) against the finished 2-step run /tmp/pr3/run1
cd /tmp/pr3
out() { echo "== $1 rc=$2 ${3}s"; grep -v "^\s*$" /tmp/pr3/x/$1.log | grep -v -i "warning: all log\|E0000\|W0000" | tail -${N:-2} | cut -c1-400; }
c() { id=$1; shift; s=$(date +%s); "$@" > /tmp/pr3/x/$id.log 2>&1; rc=$?; out $id $rc $(( $(date +%s) - s )); }
# X19 a fresh directory of the user's (notes) with --overwrite
mkdir -p u19 && echo keep > u19/notes.txt
c X19 ./E.sh /tmp/pr3/u19 --overwrite; ls u19
# X20 a symlink loop as the target
ln -sfn loop20 loop20
c X20 ./E.sh /tmp/pr3/loop20 --overwrite
# X21 / with --overwrite; X21b $HOME-like /root
c X21 ./E.sh / --overwrite
c X21b ./E.sh /root --overwrite
# X22 an empty existing directory, no --overwrite (filled); then the same again (refused)
mkdir -p e22
c X22 ./E.sh /tmp/pr3/e22; ls e22 | head -3
c X22b ./E.sh /tmp/pr3/e22
# X23 an earlier export whose manifest was edited to name ../u19/notes.txt and /tmp/pr3/u19/notes.txt
cp -r e22 e23 && python3 - <<'P'
import json; p="/tmp/pr3/e23/.hybridjax-export.json"; m=json.load(open(p))
m["files"] += ["../u19/notes.txt", "/tmp/pr3/u19/notes.txt", "."]; json.dump(m, open(p, "w"))
P
c X23 ./E.sh /tmp/pr3/e23 --overwrite; ls u19; ls -a . | grep -c replaced
# X24 an earlier export with the user's subdirectory notes/ holding a file
cp -r e22 e24 && mkdir -p e24/notes && echo mine > e24/notes/a.txt
c X24 ./E.sh /tmp/pr3/e24 --overwrite; ls e24/notes
# X25 an earlier export with the user's file replaced by a same-named one of theirs (config.json edited)
cp -r e22 e25 && echo '{"edited": true}' > e25/tokenizer_config.json.bak
c X25 ./E.sh /tmp/pr3/e25 --overwrite; ls e25 | grep bak
# X26 an earlier export that is a mount point (tmpfs), --overwrite
mkdir -p m26 && unshare --mount --propagation private sh -c 'mount -t tmpfs -o size=64m tmpfs /tmp/pr3/m26 && cp -r /tmp/pr3/e22/. /tmp/pr3/m26/ && /tmp/pr3/E.sh /tmp/pr3/m26 --overwrite > /tmp/pr3/x/X26.log 2>&1; echo "rc=$?" >> /tmp/pr3/x/X26.log; ls -a /tmp/pr3/m26 | head -4 >> /tmp/pr3/x/X26.log'; echo "== X26"; grep -v "^\s*$" x/X26.log | grep -v "E0000\|W0000" | tail -6 | cut -c1-300; ls -a /tmp/pr3 | grep "m26"
# X27 the run directory spelled //tmp//pr3//run1/ and /tmp/pr3/run1/. 
c X27 ./E.sh //tmp//pr3//run1/ --overwrite
c X27b ./E.sh /tmp/pr3/run1/. --overwrite
# X28 a live run's directory (not its parent) while it trains (second run2)
(STEPS=3 ./T.sh /tmp/pr3/run28 > x/run28.log 2>&1 &); sleep 25
c X28 ./E.sh /tmp/pr3/run28 --overwrite; c X28b ./E.sh /tmp/pr3/run28/hf
