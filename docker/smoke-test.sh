#!/usr/bin/env bash
# Smoke test of the CPU image: build it, start it, wait for /health, send one completion, read /metrics,
# then stop and remove everything it started (the image, the container, temporary files).
#
#   bash docker/smoke-test.sh                                  # base python:3.11-slim, pip online
#   MAKE_BASE=1 OFFLINE=1 bash docker/smoke-test.sh            # no registry: a local Debian base, wheels from the host
#
# Settings (environment variables):
#   BASE_IMAGE   base image for the build (default python:3.11-slim; with MAKE_BASE=1: exspec-base:bookworm)
#   MAKE_BASE=1  build BASE_IMAGE locally with debootstrap first (docker/make-debian-base.sh; root, no registry)
#   OFFLINE=1    download every wheel on the host first (pip download, honouring this host's pip configuration)
#                into the build context and build with PIP_NO_INDEX=1, so the build needs no network
#   TORCH_INDEX_URL  extra index for the host's `pip download` of the CPU torch wheel (default: pip's own config)
#   MODELS=tiny  (default) build a tiny random target/draft pair on the host and mount it at /models; the
#                image is built with BUILD_DEMO=0, which keeps the test to a few minutes on 2 cores
#   MODELS=demo  build the demo pair inside the image (BUILD_DEMO=1, as shipped) and serve it
#   KEEP_IMAGE=1 keep the built image
#   PYTHON       host python with torch and transformers, for MODELS=tiny (default .venv/bin/python)
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD

MAKE_BASE=${MAKE_BASE:-0}
if [ "$MAKE_BASE" = 1 ]; then
  BASE_IMAGE=${BASE_IMAGE:-exspec-base:bookworm}
else
  BASE_IMAGE=${BASE_IMAGE:-python:3.11-slim}
fi
OFFLINE=${OFFLINE:-0}
MODELS=${MODELS:-tiny}
PYTHON=${PYTHON:-$ROOT/.venv/bin/python}
TORCH_VERSION=2.13.0
TAG=exspec-smoke:$$
NAME=exspec-smoke-$$
WORK=$(mktemp -d /tmp/exspec-smoke.XXXXXX)

log() { printf '[smoke %s] %s\n' "$(date -u +%H:%M:%S)" "$*"; }

cleanup() {
  local rc=$?
  set +e
  if docker container inspect "$NAME" >/dev/null 2>&1; then
    if [ "$rc" != 0 ]; then
      log "container logs (last 60 lines):"
      docker logs --tail 60 "$NAME" 2>&1 | sed 's/^/    /'
    fi
    docker rm -f "$NAME" >/dev/null
    log "removed container $NAME"
  fi
  if [ "${KEEP_IMAGE:-0}" != 1 ] && docker image inspect "$TAG" >/dev/null 2>&1; then
    docker rmi -f "$TAG" >/dev/null
    log "removed image $TAG"
  fi
  rm -rf "$WORK"
  if [ "$rc" = 0 ]; then log "PASS"; else log "FAIL (exit $rc)"; fi
}
trap cleanup EXIT

log "docker $(docker version --format '{{.Client.Version}} (client) / {{.Server.Version}} (server)')"
log "base image $BASE_IMAGE, offline=$OFFLINE, models=$MODELS"

# 1. The base image.
if [ "$MAKE_BASE" = 1 ]; then
  bash docker/make-debian-base.sh "$BASE_IMAGE"
fi
if ! docker image inspect "$BASE_IMAGE" >/dev/null 2>&1; then
  log "pulling $BASE_IMAGE"
  docker pull "$BASE_IMAGE" || { log "cannot pull $BASE_IMAGE: with no registry, run with MAKE_BASE=1"; exit 1; }
fi

# 2. A small build context: the project's package directories, docker/, and (offline) the wheels.
CTX=$WORK/context
mkdir -p "$CTX"
tar -c --exclude=__pycache__ --exclude='*.pyc' --exclude='docker/wheels/*.whl' \
  pyproject.toml README.md exspec engine scheduler server cli bench demo loadtest data docker | tar -x -C "$CTX"
build_args=(--build-arg "BASE_IMAGE=$BASE_IMAGE")
if [ "$OFFLINE" = 1 ]; then
  wheels=$CTX/docker/wheels
  log "downloading wheels on the host into the build context"
  "$PYTHON" - >"$WORK/requirements.txt" <<'EOF'
import tomllib

with open("pyproject.toml", "rb") as f:
    project = tomllib.load(f)
print("\n".join(project["build-system"]["requires"] + project["project"]["dependencies"] + ["wheel"]))
EOF
  # pip's warnings go to a file, shown only when a download fails.
  pip_download() {
    "$PYTHON" -m pip download -q --dest "$wheels" "$@" 2>"$WORK/pip.log" || { cat "$WORK/pip.log"; exit 1; }
  }
  pip_download ${TORCH_INDEX_URL:+--extra-index-url "$TORCH_INDEX_URL"} "torch==$TORCH_VERSION"
  if ! ls "$wheels"/torch-"$TORCH_VERSION"+cpu-*.whl >/dev/null 2>&1; then
    log "pip found no CPU build of torch $TORCH_VERSION: set TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu"
    exit 1
  fi
  # The pin keeps the resolver on the CPU wheel just downloaded (a newer torch would bring CUDA wheels).
  echo "torch==$TORCH_VERSION" >>"$WORK/requirements.txt"
  pip_download --find-links "$wheels" -r "$WORK/requirements.txt"
  log "$(find "$wheels" -name '*.whl' | wc -l) wheels, $(du -sh "$wheels" | cut -f1)"
  build_args+=(--build-arg PIP_NO_INDEX=1)
fi
if [ "$MODELS" = tiny ]; then
  build_args+=(--build-arg BUILD_DEMO=0)
fi

# 3. Build. Without the buildx plugin the classic builder is used (the Dockerfile needs no BuildKit feature).
if ! docker buildx version >/dev/null 2>&1; then
  export DOCKER_BUILDKIT=0
fi
log "building $TAG"
start=$SECONDS
docker build -f "$CTX/docker/Dockerfile" -t "$TAG" "${build_args[@]}" ${BUILD_NETWORK:+--network "$BUILD_NETWORK"} "$CTX"
log "built in $((SECONDS - start)) s: $(docker image inspect "$TAG" --format '{{.Size}}' | awk '{printf "%.0f MB", $1 / 1e6}')"

# 4. Run it, publishing its port on a free loopback port of the host.
PORT=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
run_args=(-d --name "$NAME" -p "127.0.0.1:$PORT:8000" -e EXSPEC_MAX_BATCH_SIZE=4)
if [ "$MODELS" = tiny ]; then
  log "building a tiny model pair on the host"
  "$PYTHON" - "$WORK/models" >"$WORK/models.log" 2>&1 <<'EOF' || { cat "$WORK/models.log"; exit 1; }
import sys
from pathlib import Path

sys.path.insert(0, ".")
from tests.support.tiny_models import build_pair

target, draft = build_pair(Path(sys.argv[1]), "llama")
(Path(sys.argv[1]) / "target").symlink_to(target.name)
(Path(sys.argv[1]) / "draft").symlink_to(draft.name)
EOF
  chmod -R a+rX "$WORK"
  run_args+=(-v "$WORK/models:/models:ro" -e EXSPEC_MODEL=/models/target -e EXSPEC_DRAFT_MODEL=/models/draft
    -e EXSPEC_SERVED_MODEL_NAME=tiny)
fi
log "starting $NAME on 127.0.0.1:$PORT"
docker run "${run_args[@]}" "$TAG" >/dev/null
BASE_URL=http://127.0.0.1:$PORT

# 5. Wait for /health (and for Docker's own HEALTHCHECK to agree), then talk to the server.
log "waiting for /health"
start=$SECONDS
until python3 -c "import sys, urllib.request; sys.exit(urllib.request.urlopen('$BASE_URL/health', timeout=3).status != 200)" 2>/dev/null; do
  if [ "$(docker inspect -f '{{.State.Running}}' "$NAME")" != true ]; then
    log "the container exited"; exit 1
  fi
  if [ $((SECONDS - start)) -gt 300 ]; then
    log "no healthy answer within 300 s"; exit 1
  fi
  sleep 2
done
log "/health answered 200 after $((SECONDS - start)) s"
until [ "$(docker inspect -f '{{.State.Health.Status}}' "$NAME")" = healthy ]; do
  if [ $((SECONDS - start)) -gt 300 ]; then
    log "Docker HEALTHCHECK never reported healthy"; exit 1
  fi
  sleep 2
done
log "Docker HEALTHCHECK: $(docker inspect -f '{{.State.Health.Status}}' "$NAME")"

log "POST /v1/completions"
python3 - "$BASE_URL" <<'EOF'
import json
import sys
import urllib.request

base = sys.argv[1]
models = json.load(urllib.request.urlopen(f"{base}/v1/models", timeout=10))
model = models["data"][0]["id"]
print(f"    /v1/models: {[m['id'] for m in models['data']]}")
body = json.dumps({"model": model, "prompt": "The quick brown fox", "max_tokens": 8}).encode()
request = urllib.request.Request(f"{base}/v1/completions", data=body, headers={"Content-Type": "application/json"})
reply = json.load(urllib.request.urlopen(request, timeout=120))
text = reply["choices"][0]["text"]
assert isinstance(text, str), reply
print(f"    choices[0].text = {text!r}, finish_reason = {reply['choices'][0].get('finish_reason')!r}, usage = {reply.get('usage')}")
EOF

log "GET /metrics"
python3 - "$BASE_URL" <<'EOF'
import sys
import urllib.request

text = urllib.request.urlopen(f"{sys.argv[1]}/metrics", timeout=10).read().decode()
lines = [line for line in text.splitlines() if line.startswith("exspec_generation_tokens_total")]
assert lines, "exspec_generation_tokens_total is missing from /metrics"
for line in lines + [line for line in text.splitlines() if line.startswith("exspec_spec_decode_num_draft_tokens_total")]:
    print(f"    {line}")
EOF
log "container runs as uid $(docker exec "$NAME" id -u), serves $(docker exec "$NAME" printenv EXSPEC_MODEL || echo 'the demo pair')"

# 6. docker stop sends SIGTERM to the server (PID 1): it drains and exits 0.
log "docker stop (SIGTERM)"
start=$SECONDS
docker stop -t 40 "$NAME" >/dev/null
code=$(docker inspect -f '{{.State.ExitCode}}' "$NAME")
log "stopped after $((SECONDS - start)) s, exit code $code"
[ "$code" = 0 ] || { log "the server did not exit 0 on SIGTERM"; exit 1; }
