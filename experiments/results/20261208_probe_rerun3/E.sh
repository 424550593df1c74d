#!/bin/bash
t=$1; shift
exec /tmp/pr3/T.sh ${RUN:-/tmp/pr3/run1} --export_hf=$t "$@"
