#!/usr/bin/env bash
# make test-deploy: build the images on a debootstrapped Debian base and run them (deploy/README.md).
#
#   deploy/test-deploy.sh [all|cpu|gpu|gateway]      (make test-deploy: all; make image-gpu: gpu)
#
#   cpu: the export image and a CPU-torch trainer image (localhost/strop-trainer-cpu), run end to end (below);
#   gpu: the CUDA trainer image as the Containerfile builds it by default (localhost/strop-trainer: torch 2.11.0 and
#        its CUDA 13.0 wheels from PyPI, every wheel by hash from requirements/gpu-lock.txt; several GB), checked
#        without a GPU: deploy/gpu_smoke.py --cpu-only in it, its trainer started with --device cpu, health, drain;
#   gateway: the HTTP gateways' image (localhost/strop-gateway: strop[tinker,openai], no torch), its Tinker gateway
#        started from its entrypoint against a trainer run from this checkout, driven by the official tinker SDK
#        (deploy/gateway_check.py);
#   all: all three.
#
#   1. a Debian bookworm base made with debootstrap (no container registry is reachable here), committed as
#      localhost/strop-base:bookworm (kept between runs; DEPLOY_REBASE=1 remakes it);
#   2. the build context: the repository's files (the working tree, or DEPLOY_SOURCE=HEAD for the last commit's
#      sources with this working tree's deploy/) plus two wheels: the CPU torch from PyTorch's CPU index
#      (DEPLOY_TORCH_INDEX; a pip find-links holding it is used first) and llama-cpp-python built from the lock's
#      sdist by pip (its hash checked; ~10 min on 2 cores unless pip's cache has the wheel);
#   3. buildah bud --isolation chroot of deploy/Containerfile.export and deploy/Containerfile.trainer, timed;
#   4. deploy/image_check.py: both services started from their images' filesystems and entrypoints, driven
#      through the SDK (health, a few training steps, an export verified in llama.cpp, SIGTERM drain).
#
# Needs root, buildah, debootstrap and the repo's .venv (make setup). Large files stay under DEPLOY_WORK.
set -euo pipefail

MODE=${1:-all}
case "$MODE" in all|cpu|gpu|gateway) ;; *) echo "usage: $0 [all|cpu|gpu|gateway]"; exit 2 ;; esac
cpu() { [ "$MODE" = all ] || [ "$MODE" = cpu ]; }
gpu() { [ "$MODE" = all ] || [ "$MODE" = gpu ]; }
gw() { [ "$MODE" = all ] || [ "$MODE" = gateway ]; }
REPO=$(cd "$(dirname "$0")/.." && pwd)
WORK=${DEPLOY_WORK:-/var/tmp/strop-deploy}
SOURCE=${DEPLOY_SOURCE:-worktree}
VPY=${VPY:-$REPO/.venv/bin/python}
BASE=localhost/strop-base:bookworm
# The images are tagged with pyproject's version: the names deploy/k8s/overlays/dev runs (localhost/strop-*).
VERSION=$(sed -n 's/^version = "\(.*\)"$/\1/p' "$REPO/pyproject.toml")
TAG=${DEPLOY_TAG:-$VERSION}
TORCH_INDEX=${DEPLOY_TORCH_INDEX:-https://download.pytorch.org/whl/cpu}
TORCH_SPEC=$(grep -m1 '^torch==' "$REPO/requirements/torch-cpu.txt")
MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
# What the Containerfiles COPY (nothing else enters the context).
PATHS=(pyproject.toml README.md requirements protos common client cli gateways graders export_svc trainer_svc kernels fixtures demo)

log() { printf '\n=== %s\n' "$*"; }
now() { date +%s.%N; }
secs() { python3 -c "print(f'{$2 - $1:.0f}')"; }

for tool in buildah debootstrap; do
    command -v "$tool" >/dev/null || { echo "test-deploy: $tool is missing (apt-get install buildah debootstrap)"; exit 2; }
done
[ "$(id -u)" = 0 ] || { echo "test-deploy: needs root (debootstrap, buildah, chroot)"; exit 2; }
mkdir -p "$WORK"

log "1. Debian bookworm base ($BASE)"
t0=$(now)
if [ "${DEPLOY_REBASE:-0}" = 1 ]; then buildah rmi -f "$BASE" >/dev/null 2>&1 || true; fi
if buildah inspect --type image "$BASE" >/dev/null 2>&1; then
    echo "kept from an earlier run (DEPLOY_REBASE=1 remakes it)"
else
    rm -rf "$WORK/rootfs"
    debootstrap --variant=minbase --include=ca-certificates bookworm "$WORK/rootfs" "$MIRROR" >"$WORK/debootstrap.log"
    rm -rf "$WORK/rootfs/var/cache/apt/archives/"*.deb "$WORK/rootfs/var/lib/apt/lists/"*
    ctr=$(buildah from scratch)
    mnt=$(buildah mount "$ctr")
    cp -a "$WORK/rootfs/." "$mnt/"
    buildah umount "$ctr" >/dev/null
    buildah config --env PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin --cmd /bin/bash "$ctr"
    buildah commit --rm -q "$ctr" "$BASE" >/dev/null
    rm -rf "$WORK/rootfs"
fi
base_s=$(secs "$t0" "$(now)")

log "2. build context ($SOURCE) and carried wheels"
ctx="$WORK/context"
rm -rf "$ctx" && mkdir -p "$ctx"
cd "$REPO"
if [ "$SOURCE" = HEAD ]; then
    git archive HEAD -- "${PATHS[@]}" | tar -x -C "$ctx"
    commit="$(git rev-parse --short HEAD) (sources) + working-tree deploy/"
else
    git ls-files -z -c -o --exclude-standard -- "${PATHS[@]}" | tar --null -T - -c | tar -x -C "$ctx"
    commit="$(git rev-parse --short HEAD)$(git diff --quiet HEAD -- "${PATHS[@]}" || echo ' + uncommitted changes')"
fi
git ls-files -z -c -o --exclude-standard -- deploy | tar --null -T - -c | tar -x -C "$ctx"
mkdir -p "$ctx/deploy/wheels"
if cpu; then
    # The CPU build from PyTorch's CPU index (PyPI's Linux torch is the CUDA build, several GB more and not what the
    # CPU images run); a find-links in pip's configuration that holds it (the CI machines' disk) is used first.
    "$VPY" -m pip download -q --no-deps --index-url "$TORCH_INDEX" "$TORCH_SPEC" -d "$ctx/deploy/wheels"
    # llama-cpp-python is sdist-only: pip builds the wheel from the lock's sdist (--require-hashes checks it), portable
    # (LLAMA_CMAKE_ARGS, the Makefile's: not for this host's CPU, which the image's nodes need not share) and outside
    # pip's wheel cache (which may hold a native build of the same sdist).
    grep -A3 '^llama-cpp-python==' requirements/lock.txt | sed '/# via/,$d' >"$WORK/llama-lock.txt"
    CMAKE_ARGS="${LLAMA_CMAKE_ARGS:--DGGML_NATIVE=OFF}" "$VPY" -m pip wheel -q --no-deps --no-cache-dir \
        --require-hashes -r "$WORK/llama-lock.txt" -w "$ctx/deploy/wheels"
    ls -l "$ctx/deploy/wheels"/*.whl
    ls "$ctx/deploy/wheels"/torch-*+cpu-*.whl >/dev/null || { echo "test-deploy: expected the CPU torch wheel"; exit 1; }
fi
# The builder's pip reaches the package index through whatever this host's pip trusts (here a proxy with its own
# CA): carry the host's CA bundle and a pip.conf naming it (builder stage only).
if [ -n "${PIP_CERT:-}" ] && [ -f "$PIP_CERT" ]; then
    cp "$PIP_CERT" "$ctx/deploy/wheels/ca-bundle.crt"
    printf '[global]\ncert = /wheels/ca-bundle.crt\n' >"$ctx/deploy/wheels/pip.conf"
fi

build() {  # build LABEL CONTAINERFILE IMAGE EXTRA_ARGS...
    local label=$1 file=$2 image=$3; shift 3
    local t0; t0=$(now)
    # --layers keeps each step's layer, so a rerun after a change to deploy/ rebuilds from the changed step on;
    # DEPLOY_NO_CACHE=1 rebuilds every step (the figures in deploy/README.md are such a run).
    buildah bud --isolation chroot --layers ${DEPLOY_NO_CACHE:+--no-cache} -q -f "deploy/Containerfile.$file" \
        --build-arg BASE_IMAGE="$BASE" "$@" -t "$image" "$ctx" >"$WORK/build-$label.log" 2>&1 \
        || { tail -40 "$WORK/build-$label.log"; echo "test-deploy: the $label image did not build (log $WORK/build-$label.log)"; exit 1; }
    eval "${label//-/_}_s=$(secs "$t0" "$(now)")"
}
# The CPU builds take torch from the carried wheel; the CUDA trainer (the Containerfile's defaults) from its lock.
CPU_TORCH=(--build-arg TORCH_SPEC="$TORCH_SPEC" --build-arg TORCH_PIP_ARGS="--no-index --find-links /wheels")
# The names deploy/k8s/overlays/dev runs: localhost/strop-trainer (the CUDA build) and localhost/strop-export.
EXPORT_IMAGE="localhost/strop-export:$TAG"
TRAINER_IMAGE="localhost/strop-trainer:$TAG"
TRAINER_CPU_IMAGE="localhost/strop-trainer-cpu:$TAG"
GATEWAY_IMAGE="localhost/strop-gateway:$TAG"

cd "$ctx"
if cpu; then
    log "3a. export image (buildah bud --isolation chroot)"
    build export export "$EXPORT_IMAGE" "${CPU_TORCH[@]}"
    log "3b. trainer image, CPU torch (buildah bud --isolation chroot)"
    build trainer-cpu trainer "$TRAINER_CPU_IMAGE" "${CPU_TORCH[@]}" --build-arg TRAIN_LOCK=
fi
if gpu; then
    log "3c. trainer image, CUDA torch from requirements/gpu-lock.txt (buildah bud --isolation chroot)"
    build trainer-gpu trainer "$TRAINER_IMAGE"
fi
if gw; then
    log "3d. gateway image, no torch (buildah bud --isolation chroot)"
    build gateway gateway "$GATEWAY_IMAGE"
fi
cd "$REPO"

size() { buildah images --format '{{.Size}}' "$1" | head -1; }
if cpu; then
    log "4. services from the images, driven through the SDK"
    t0=$(now)
    "$VPY" -P deploy/image_check.py --work "$WORK" \
        --trainer-image "$TRAINER_CPU_IMAGE" --export-image "$EXPORT_IMAGE" | tee "$WORK/image-check.out"
    run_s=$(secs "$t0" "$(now)")
fi
if gpu; then
    log "5. the CUDA trainer image without a GPU: its smoke test's CPU half, the service from its entrypoint"
    t0=$(now)
    "$VPY" -P deploy/image_check.py --work "$WORK" --gpu-image "$TRAINER_IMAGE" | tee "$WORK/image-check-gpu.out"
    gpu_run_s=$(secs "$t0" "$(now)")
fi

if gw; then
    log "6. the Tinker gateway from its image, driven by the tinker SDK"
    t0=$(now)
    "$VPY" -P deploy/gateway_check.py --work "$WORK" --gateway-image "$GATEWAY_IMAGE" --python "$VPY" \
        | tee "$WORK/gateway-check.out"
    gw_run_s=$(secs "$t0" "$(now)")
fi

log "figures ($(date -u +%F), $commit)"
printf '| step | seconds | image size |\n|---|---|---|\n'
printf '| debootstrap base | %s | %s |\n' "$base_s" "$(size "$BASE")"
if cpu; then
    printf '| export image build | %s | %s |\n' "$export_s" "$(size "$EXPORT_IMAGE")"
    printf '| trainer image build (CPU torch) | %s | %s |\n' "$trainer_cpu_s" "$(size "$TRAINER_CPU_IMAGE")"
    printf '| run + drive both services | %s | |\n' "$run_s"
fi
if gpu; then
    printf '| trainer image build (CUDA torch) | %s | %s |\n' "$trainer_gpu_s" "$(size "$TRAINER_IMAGE")"
    printf '| CUDA image: smoke (CPU half) + service | %s | |\n' "$gpu_run_s"
fi
if gw; then
    printf '| gateway image build | %s | %s |\n' "$gateway_s" "$(size "$GATEWAY_IMAGE")"
    printf '| gateway: SDK loop through its image | %s | |\n' "$gw_run_s"
fi
echo "test-deploy: OK ($MODE)"
