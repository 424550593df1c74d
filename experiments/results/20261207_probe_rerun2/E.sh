#!/bin/bash
t=$1; shift
exec /tmp/pr2/T.sh ${RUN:-/tmp/pr2/run1} --export_hf=$t "$@"
