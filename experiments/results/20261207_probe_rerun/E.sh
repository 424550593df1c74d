#!/bin/bash
t=$1; shift
exec /tmp/pr/T.sh ${RUN:-/tmp/pr/run1} --export_hf=$t "$@"
