#!/usr/bin/env bash
# Issue 31's GPU bar: the facts recipe (bench/recipe_facts.py) over ten seeds on the device machine at once. A set
# runs longer than one device call may (ten processes on an H100: ~8 minutes of training, then the evaluations;
# twenty ran out of its memory), so the seeds run detached from the call that starts them, and later calls wait:
#   call 1, carry .carry/smollm2-a:                    bash bench/gpu_facts_seeds.sh keep
#   call 2, carry .whl .carry/smollm2-b .carry/smollm2-py:
#                                                      source bench/gpu_env.sh && bash bench/gpu_facts_seeds.sh start [SETTING]
#   calls 3…, on the warm machine, each right after the last (it is released after 30 s idle):
#                                                      bash bench/gpu_facts_seeds.sh wait 560
# SETTING (optional) is added to each run's seed=S (e.g. retention.LEAD_FLOOR=0.25). `wait` returns when every run
# has ended or after its seconds, and copies the rows (facts.jsonl) and each run's summary line to $OUT.
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
    rm -rf "$runs" && mkdir -p "$runs"
    # the base's evaluation is cached beside the model: one run writes it before the others start
    for s in 0 1 2 3 4 5 6 7 8 9; do
      setsid nohup python3 bench/recipe_facts.py --device cuda --threads 1 --setting "seed=$s${2:+,$2}" \
        --out "$runs/d$s.jsonl" > "$runs/d$s.log" 2>&1 < /dev/null &
      if [ "$s" = 0 ]; then
        until grep -q "^base:" "$runs/d0.log" || ! pgrep -f "recipe_facts.py" > /dev/null; do sleep 2; done
        grep "^base:" "$runs/d0.log"
      fi
    done
    echo "started: $(pgrep -fc recipe_facts.py) runs"
    ;;
  wait)
    end=$(( $(date +%s) + ${2:-560} ))
    while [ "$(date +%s)" -lt "$end" ] && pgrep -f recipe_facts.py > /dev/null; do sleep 5; done
    echo "still running: $(pgrep -fc recipe_facts.py)"
    cat "$runs"/d*.jsonl > "$OUT/facts.jsonl" 2>/dev/null
    for s in 0 1 2 3 4 5 6 7 8 9; do
      echo "== seed $s: $(grep -E '^seed=|Error|Killed' "$runs/d$s.log" | tail -1 | cut -c1-240)"
    done | tee "$OUT/facts-summaries.txt"
    ;;
  *)
    echo "usage: $0 keep | start [SETTING] | wait [SECONDS]" >&2
    exit 2
    ;;
esac
