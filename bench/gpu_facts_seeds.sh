#!/usr/bin/env bash
# Issue 31's GPU bar: the facts recipe (bench/recipe_facts.py) over ten seeds on the device machine at once. A set
# outlasts one device call (ten processes on an H100: ~8 minutes of training, then the evaluations; twenty ran out
# of its memory), so it runs under bench/detached.sh:
#   call 1, carry .carry/smollm2-a:                    bash bench/gpu_facts_seeds.sh keep
#   call 2, carry .whl .carry/smollm2-b .carry/smollm2-py:
#                                                      source bench/gpu_env.sh && bash bench/gpu_facts_seeds.sh start [SETTING]
#   calls 3…, each within the warm window after the last:
#                                                      bash bench/gpu_facts_seeds.sh wait 560
# SETTING (optional) is added to each run's seed=S (e.g. retention.LEAD_FLOOR=0.25). `wait` returns when the set has
# ended or after its seconds, and copies the rows (facts.jsonl) and each run's summary line to $OUT.
set -uo pipefail
cd "$(dirname "$0")/.."
runs=/tmp/facts-seeds
case "${1:-}" in
  keep)
    mkdir -p /tmp/keep && cp -r .carry/smollm2-a /tmp/keep/ && echo "kept .carry/smollm2-a"
    ;;
  start)
    [ -d .carry/smollm2-a ] || cp -r /tmp/keep/smollm2-a .carry/
    bash bench/gpu_smollm2.sh --install 2>&1 | tail -1
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
    bash bench/detached.sh start facts-seeds bash bench/gpu_facts_seeds.sh run "${2:-}"
    ;;
  run)  # the set itself, in the foreground (what `start` detaches)
    rm -rf "$runs" && mkdir -p "$runs"
    for s in 0 1 2 3 4 5 6 7 8 9; do
      python3 bench/recipe_facts.py --device cuda --threads 1 --setting "seed=$s${2:+,$2}" \
        --out "$runs/d$s.jsonl" > "$runs/d$s.log" 2>&1 &
      if [ "$s" = 0 ]; then  # the base's evaluation is cached beside the model: one run writes it first
        until grep -q "^base:" "$runs/d0.log" || ! kill -0 $! 2> /dev/null; do sleep 2; done
        grep "^base:" "$runs/d0.log"
      fi
    done
    wait
    ;;
  wait)
    bash bench/detached.sh wait facts-seeds "${2:-560}" | head -2
    cat "$runs"/d*.jsonl > "$OUT/facts.jsonl" 2> /dev/null
    for s in 0 1 2 3 4 5 6 7 8 9; do
      echo "== seed $s: $(grep -E '^seed=|Error|Killed' "$runs/d$s.log" | tail -1 | cut -c1-240)"
    done | tee "$OUT/facts-summaries.txt"
    ;;
  *)
    echo "usage: $0 keep | start [SETTING] | wait [SECONDS]" >&2
    exit 2
    ;;
esac
