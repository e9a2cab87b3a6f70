#!/usr/bin/env bash
# A benchmark longer than one device call (10 minutes at most), e.g. a 512K-token step of the 8B model (~10 min):
# `start` runs it in a session of its own, which the end of the call that started it does not stop (it runs until
# the machine is given back); each `wait`, in a call made within the machine's warm window (30 s) after the last,
# waits up to SECONDS for it to end and copies its log to $OUT. Source bench/gpu_env.sh before `start`: the
# benchmark inherits that environment.
#   bash bench/detached.sh start NAME python3 bench/train_bench.py --parts context --context 524288 ...
#   bash bench/detached.sh wait NAME 570
set -u
dir=/tmp/strop-detached
mkdir -p "$dir"
what=${1:-}
name=${2:-}
[ -n "$name" ] || { echo "usage: $0 start NAME CMD... | wait NAME SECONDS" >&2; exit 2; }
case "$what" in
  start)
    shift 2
    rm -f "$dir/$name.rc"
    printf '%q ' "$@" > "$dir/$name.cmd"
    setsid nohup bash -c "$(cat "$dir/$name.cmd") > '$dir/$name.log' 2>&1; echo \$? > '$dir/$name.rc'" \
      > /dev/null 2>&1 < /dev/null &
    echo "started $name (pid $!): $(cat "$dir/$name.cmd")"
    ;;
  wait)
    limit=${3:-570}
    end=$((SECONDS + limit))
    while [ ! -f "$dir/$name.rc" ] && [ "$SECONDS" -lt "$end" ]; do sleep 5; done
    [ -n "${OUT:-}" ] && cp "$dir/$name.log" "$OUT/"
    if [ -f "$dir/$name.rc" ]; then echo "$name ended, rc $(cat "$dir/$name.rc")"; else echo "$name still running"; fi
    tail -n 20 "$dir/$name.log"
    ;;
  *) echo "usage: $0 start NAME CMD... | wait NAME SECONDS" >&2; exit 2 ;;
esac
