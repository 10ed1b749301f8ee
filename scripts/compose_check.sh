#!/usr/bin/env bash
# Builds the image from the Dockerfile and runs compose.yaml for real, with Debian's podman serving the
# Docker API and Debian's docker-compose driving it; then checks the stack through its published ports:
# a streamed generation, the OpenAI-compatible HTTP API (/v1/models and a completion), /metrics, the C++ CPU
# kernels built into the image loaded by the executor, and an
# executor restart with a stream in flight (which must finish with
# exactly the tokens of an undisturbed greedy run, and start from the start-up cache the first start wrote), then
# two executors (--scale executor=2) both serving, the new one from the same cache (a volume); then
# compose.tiers.yaml (executor, engine-core, frontend): the engine-core container and then the frontend container
# SIGKILLed and started again, each with a client-library stream (--resume-attempts) in flight that must end with
# the undisturbed run's tokens.
# Prints one line per stage with its time.
#
#   bash scripts/compose_check.sh            # needs root or sudo; .venv must exist (scripts/setup.sh)
#
# Everything engine-specific lives here, not in the Dockerfile: the locally made base image (no image
# registry is reachable), podman's settings, the machine's pip set-up mounted into the build, and the
# healthcheck loop (podman runs healthchecks from systemd timers; there is no systemd here).
# Kept between runs: the installed packages, the base image, the image and its build cache.
# Removed on exit, pass or fail: the containers, the network, the API service and every process started.
#
# Settings (environment): GRPC_PORT / HTTP_PORT / METRICS_PORT publish the scheduler on 127.0.0.1 (default: free
# ports), BASE_IMAGE (default localhost/debian:bookworm, made with debootstrap when missing),
# DEBIAN_MIRROR, TORCH_INDEX_URL (default: the index pip uses here), PAGEDSERVE_TAG (default
# compose-check), RESTART_MAX_TOKENS (length of the stream that lives through the restart, default 960;
# prompt + it must fit the default model's max_model_len, 1024),
# EXECUTOR_WAIT_TIMEOUT (the scheduler's --executor-wait-timeout, default 120 here; see below),
# COMPOSE_CHECK_KEEP_LOGS=1 (true/yes/on) keeps the log directory on success too; 0/false/no/off or unset does
# not (read as every pagedserve switch is, client/switches.py: another value stops the check at once).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD

SUDO=""
[ "$(id -u)" -eq 0 ] || SUDO="sudo"
AS_ROOT=()
[ -z "$SUDO" ] || AS_ROOT=(sudo)
PY=${PYTHON:-$ROOT/.venv/bin/python}
[ -x "$PY" ] || { echo "[compose_check] $PY is missing: run scripts/setup.sh first"; exit 1; }
KEEP_LOGS=$("$PY" -m client.switches COMPOSE_CHECK_KEEP_LOGS off) || exit 2
BASE_IMAGE=${BASE_IMAGE:-localhost/debian:bookworm}
DEBIAN_MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
export PAGEDSERVE_TAG=${PAGEDSERVE_TAG:-compose-check}
IMAGE=pagedserve:$PAGEDSERVE_TAG
RESTART_MAX_TOKENS=${RESTART_MAX_TOKENS:-960}
# How long the scheduler holds a call while the executor restarts. On a busy two-core machine the new
# executor container needed up to ~30 s to serve again (mostly importing torch): past compose's default of
# 30 s the restarted stream would end UNAVAILABLE, which is the timeout working, not the recovery failing.
EXECUTOR_WAIT_TIMEOUT=${EXECUTOR_WAIT_TIMEOUT:-120}
PACKAGES=(podman runc debootstrap docker-compose catatonit netavark aardvark-dns)
PROJECT=pagedservecheck$$
WORK=$(mktemp -d "/tmp/compose-check.$$.XXXXXX")
LOG=$WORK/log
SOCK=$WORK/podman.sock
export CONTAINERS_CONF=$WORK/containers.conf
export DOCKER_HOST=unix://$SOCK
export COMPOSE_PROJECT_NAME=$PROJECT
export PUBLISH_ADDRESS=127.0.0.1
: >"$LOG"
: >"$WORK/no.env"  # compose reads no .env: the check runs the defaults plus the ports chosen here

podman_() { $SUDO env CONTAINERS_CONF="$CONTAINERS_CONF" podman "$@"; }
free_port() { "$PY" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
GRPC_PORT=${GRPC_PORT:-$(free_port)}
METRICS_PORT=${METRICS_PORT:-$(free_port)}
while [ "$METRICS_PORT" = "$GRPC_PORT" ]; do METRICS_PORT=$(free_port); done
HTTP_PORT=${HTTP_PORT:-$(free_port)}
while [ "$HTTP_PORT" = "$GRPC_PORT" ] || [ "$HTTP_PORT" = "$METRICS_PORT" ]; do HTTP_PORT=$(free_port); done
export GRPC_PORT METRICS_PORT HTTP_PORT
SERVER=127.0.0.1:$GRPC_PORT
COMPOSE=("${AS_ROOT[@]}" env CONTAINERS_CONF="$CONTAINERS_CONF" DOCKER_HOST="$DOCKER_HOST" COMPOSE_PROJECT_NAME="$PROJECT"
  PAGEDSERVE_TAG="$PAGEDSERVE_TAG" GRPC_PORT="$GRPC_PORT" HTTP_PORT="$HTTP_PORT" METRICS_PORT="$METRICS_PORT" EXECUTOR_WAIT_TIMEOUT="$EXECUTOR_WAIT_TIMEOUT"
  PUBLISH_ADDRESS="$PUBLISH_ADDRESS" docker-compose --env-file "$WORK/no.env" -f "$ROOT/compose.yaml")
compose() { "${COMPOSE[@]}" "$@"; }
TIERS=("${COMPOSE[@]:0:${#COMPOSE[@]}-1}" "$ROOT/compose.tiers.yaml")  # the three-tier layout, same settings

log() { echo "[compose_check] $*"; }

# stage NAME FUNCTION: runs FUNCTION under `set -e` with its output in the log; one line with its time.
# Stages run in subshells, so a stage that starts a process records its pid under $WORK for cleanup.
stage() {
  local name=$1 t0=$EPOCHREALTIME rc first
  shift
  echo "=== $name" >>"$LOG"
  first=$(wc -l <"$LOG")
  set +e
  (set -e; "$@") >>"$LOG" 2>&1
  rc=$?
  set -e
  local secs
  secs=$(awk -v a="$t0" -v b="$EPOCHREALTIME" 'BEGIN { printf "%.1f", b - a }')
  if [ "$rc" -ne 0 ]; then
    log "$(printf '%-26s FAILED after %ss (exit %s); log: %s' "$name" "$secs" "$rc" "$LOG")"
    tail -n +"$first" "$LOG" | tail -n 60 | sed 's/^/    /'
    exit "$rc"
  fi
  log "$(printf '%-26s %7ss  %s' "$name" "$secs" "$(cat "$WORK/note" 2>/dev/null)")"
  rm -f "$WORK/note"
}
note() { echo "$*" >"$WORK/note"; echo "$*"; }

# ------------------------------------------------------------------------------------------- stages
install_packages() {
  local missing=() p
  for p in "${PACKAGES[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
  done
  if [ ${#missing[@]} -eq 0 ]; then note "all present"; return; fi
  $SUDO apt-get update -qq
  $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}"
  note "installed ${missing[*]}"
}

# crun refuses this machine's hybrid cgroups, setting rlimits is not permitted, and there is no systemd.
configure_podman() {
  cat >"$CONTAINERS_CONF" <<'EOF'
[containers]
default_ulimits = []
default_sysctls = ["net.ipv4.ping_group_range=0 0"]

[engine]
runtime = "runc"
cgroup_manager = "cgroupfs"
events_logger = "file"

[network]
network_backend = "netavark"
EOF
  podman_ info --format '{{.Host.OCIRuntime.Name}} {{.Host.CgroupManager}} {{.Host.NetworkBackend}}' | tee "$WORK/note"
}

# What earlier runs killed before their cleanup left (their pid is gone): containers, networks, processes.
clear_stale_runs() {
  local id project net n=0
  while read -r id project; do
    case $project in pagedservecheck[0-9]*) ;; *) continue ;; esac
    [ -d "/proc/${project#pagedservecheck}" ] && continue
    podman_ rm -f "$id" >/dev/null && n=$((n + 1))
  done < <(podman_ ps -a --format '{{.ID}} {{index .Labels "com.docker.compose.project"}}')
  for net in $(podman_ network ls --format '{{.Name}}' | grep -E '^pagedservecheck[0-9]+_default$' || true); do
    project=${net%_default}
    [ -d "/proc/${project#pagedservecheck}" ] && continue
    podman_ network rm -f "$net" >/dev/null && n=$((n + 1))
  done
  local dir f pid
  for dir in /tmp/compose-check.*.*; do  # the API service and loops of killed runs: pid files in their dirs
    pid=${dir#/tmp/compose-check.}
    [ -d "/proc/${pid%%.*}" ] && continue
    for f in "$dir"/*.pid; do
      [ -f "$f" ] || continue
      pid=$(cat "$f")
      if tr '\0' ' ' <"/proc/$pid/cmdline" 2>/dev/null | grep -qE "$dir|compose_check|client generate"; then
        $SUDO kill "$pid" && n=$((n + 1))
      fi
      $SUDO rm -f "$f"
    done
  done
  note "removed $n left by killed runs"
}

# A Debian base image from Debian's own packages: no image registry is reachable from here.
make_base_image() {
  if podman_ image exists "$BASE_IMAGE"; then note "reused $BASE_IMAGE"; return; fi
  case $BASE_IMAGE in localhost/debian:*) ;; *) podman_ pull "$BASE_IMAGE"; note "pulled"; return ;; esac
  local suite=${BASE_IMAGE#localhost/debian:}
  $SUDO debootstrap --variant=minbase "$suite" "$WORK/rootfs" "$DEBIAN_MIRROR"
  $SUDO find "$WORK/rootfs/var/cache/apt/archives" "$WORK/rootfs/var/lib/apt/lists" -type f -delete
  $SUDO tar -C "$WORK/rootfs" -c . | podman_ import - "$BASE_IMAGE"
  $SUDO rm -rf "$WORK/rootfs"
  note "made $BASE_IMAGE with debootstrap"
}

# The machine's pip set-up for the build: its settings (`pip config list`: files and PIP_* variables) as
# root's pip.conf in a scratch home mounted over /root, and what they name (wheel directories, local index
# roots, constraint files, the CA bundle pip trusts) mounted read-only under it. /root exists in any Debian
# base, so the build leaves no mount point behind in the image, and the image's /etc stays its own.
# Prints one `-v` argument a line.
pip_mounts() {
  "$PY" - "$WORK/home" <<'EOF'
import configparser, os, subprocess, sys
home, inside = sys.argv[1], "/root"
listing = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True, check=True)
rows = [line.partition("=") for line in listing.stdout.splitlines() if "=" in line]
rows.sort(key=lambda row: row[0].startswith(":env:"))  # the environment overrides the files, as in pip
conf, mounts = configparser.ConfigParser(), {}

def mount(path: str) -> str:
    """The path inside the build where the host's `path` appears (read-only)."""
    if path not in mounts:
        mounts[path] = f".host/{len(mounts)}"
        target = os.path.join(home, mounts[path])
        os.makedirs(os.path.dirname(target), exist_ok=True)
        os.makedirs(target, exist_ok=True) if os.path.isdir(path) else open(target, "w").close()
    return f"{inside}/{mounts[path]}"

def translate(name: str, value: str) -> str:
    if name in ("cert", "client-cert", "constraint", "requirement"):
        return mount(value) if os.path.isfile(value) else value
    if name == "find-links":
        return " ".join(mount(v) if os.path.isdir(v) else v for v in value.split())
    out = []  # index URLs: a local index's pages link to files beside `simple/`, so mount its parent
    for url in value.split():
        path = url.removeprefix("file://").rstrip("/")
        root = os.path.dirname(path)
        local = url.startswith("file:///") and os.path.isdir(root)
        out.append(f"file://{mount(root)}/{os.path.basename(path)}" if local else url)
    return " ".join(out)

for key, _, value in rows:
    section, _, name = key.partition(".")
    section = "global" if section == ":env:" else section
    if name in ("cert", "client-cert", "constraint", "requirement", "find-links", "index-url", "extra-index-url"):
        value = translate(name, value.strip("'"))
    conf.setdefault(section, {})[name] = value.strip("'")
os.makedirs(os.path.join(home, ".config/pip"), exist_ok=True)
with open(os.path.join(home, ".config/pip/pip.conf"), "w") as f:
    conf.write(f)
print(f"{home}:{inside}")
for host, rel in mounts.items():
    print(f"{host}:{inside}/{rel}:ro")
EOF
}
torch_index_url() {
  local url
  url=$("$PY" -m pip config get global.index-url 2>/dev/null || true)
  echo "${TORCH_INDEX_URL:-${PIP_INDEX_URL:-${url:-https://pypi.org/simple}}}"
}

build_image() {
  local args=() mount old new
  while IFS= read -r mount; do args+=(-v "$mount"); done < <(pip_mounts)
  echo "pip mounts: ${args[*]}"
  old=$(podman_ image inspect --format '{{.Id}}' "$IMAGE" 2>/dev/null || true)
  podman_ build --network host --layers "${args[@]}" \
    --build-arg BASE_IMAGE="$BASE_IMAGE" --build-arg TORCH_INDEX_URL="$(torch_index_url)" \
    -t "$IMAGE" -f Dockerfile .
  new=$(podman_ image inspect --format '{{.Id}}' "$IMAGE")
  if [ -n "$old" ] && [ "$old" != "$new" ]; then
    podman_ rmi "$old" >/dev/null 2>&1 || true
    note "$IMAGE rebuilt ($(grep -c '^--> Using cache' "$LOG" || true) cached steps)"
  else
    note "$IMAGE $([ -n "$old" ] && echo "unchanged, from cache" || echo built)"
  fi
}

start_api_service() {
  $SUDO env CONTAINERS_CONF="$CONTAINERS_CONF" podman system service --time=0 "unix://$SOCK" >"$WORK/service.log" 2>&1 &
  echo $! >"$WORK/service.pid"
  for _ in $(seq 300); do
    [ -S "$SOCK" ] && break
    sleep 0.1
  done
  [ -S "$SOCK" ]
  note "$SOCK"
}

# podman runs healthchecks from systemd timers; with no systemd they run only when asked, so ask.
start_healthchecks() {
  (
    while :; do
      for c in $(podman_ ps -q --filter "label=com.docker.compose.project=$PROJECT"); do
        podman_ healthcheck run "$c" >/dev/null 2>&1 || true
      done
      sleep 3
    done
  ) >/dev/null 2>&1 &
  echo $! >"$WORK/healthchecks.pid"
}

compose_up() {
  start_healthchecks
  timeout 600 "${COMPOSE[@]}" up -d --no-build
  note "project $PROJECT, grpc 127.0.0.1:$GRPC_PORT, http 127.0.0.1:$HTTP_PORT, metrics 127.0.0.1:$METRICS_PORT"
}

container_of() {
  podman_ ps -q --filter "label=com.docker.compose.project=$PROJECT" --filter "label=com.docker.compose.service=$1"
}
health_of() { podman_ inspect --format '{{.State.Health.Status}}' "$(container_of "$1" | head -n 1)"; }
wait_healthy() { wait_services "${1:-300}" executor scheduler; }
wait_services() {
  local deadline=$((SECONDS + $1)) service
  shift
  for service in "$@"; do
    until [ "$(health_of "$service")" = healthy ]; do
      [ $SECONDS -lt $deadline ] || { echo "$service is not healthy"; compose logs --tail 50; return 1; }
      sleep 1
    done
  done
  "$PY" -m client health --server "$SERVER"
  note "$* healthy"
}

generate() { "$PY" -m client generate --server "$SERVER" --json "$@"; }

check_generate() {
  generate --max-tokens 32 --temperature 0 "Hello from compose" >"$WORK/hello.jsonl"
  "$PY" - "$WORK/hello.jsonl" <<'EOF'
import json, sys
lines = [json.loads(x) for x in open(sys.argv[1])]
tokens = [t for x in lines for t in x["token_ids"]]
assert lines and lines[-1]["finish_reason"] in ("length", "stop"), lines[-1:]
assert 0 < len(tokens) <= 32 and lines[-1]["usage"]["completion_tokens"] == len(tokens), lines[-1]
print(f"{len(tokens)} tokens in {len(lines)} messages")
EOF
  note "$(tail -n 1 "$LOG")"
}

check_http() {
  "$PY" - "http://127.0.0.1:$HTTP_PORT/v1" <<'EOF' | tee "$WORK/note"
import json, sys, urllib.request
base = sys.argv[1]
models = json.loads(urllib.request.urlopen(f"{base}/models", timeout=10).read())
assert models["data"], models
body = json.dumps({"prompt": "Hello over HTTP", "max_tokens": 8, "temperature": 0, "ignore_eos": True}).encode()
request = urllib.request.Request(f"{base}/completions", data=body, headers={"Content-Type": "application/json"})
reply = json.loads(urllib.request.urlopen(request, timeout=120).read())
assert reply["choices"][0]["finish_reason"] == "length" and reply["usage"]["completion_tokens"] == 8, reply
print(f"model {models['data'][0]['id']}: 8 tokens over HTTP")
EOF
}

check_metrics() {
  "$PY" - "http://127.0.0.1:$METRICS_PORT/metrics" <<'EOF' | tee "$WORK/note"
import sys, urllib.request
text = urllib.request.urlopen(sys.argv[1], timeout=10).read().decode()
def total(name: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name))
done, tokens = total("vllm:request_success_total"), total("vllm:generation_tokens_total")
assert done >= 1 and tokens >= 1, (done, tokens)
print(f"{done:.0f} requests, {tokens:.0f} generation tokens")
EOF
}

# The image ships the executor's C++ CPU kernels built for this CPU: the executor must load them, not warn and
# fall back to torch.
check_kernels() {
  local text
  text=$(compose logs --no-color executor 2>&1)
  if grep "unavailable" <<<"$text"; then return 1; fi
  note "$(grep -o 'linear weights packed for .*' <<<"$text" | head -n 1)"
}

# The image lets the executor's user write its start-up cache and nothing else under /opt (its code, kernels and
# model stay root's); the first start keeps the packing choice it measured there, for the restart below to reuse
# (a failed write logs "not kept: start-up cache ... not written": every container then measured again after ready).
check_startup_cache_kept() {
  local id deadline=$((SECONDS + 300)) writable text
  id=$(container_of executor)
  writable=$(podman_ exec "$id" find /opt -writable -not -path /opt/pagedserve/cache/startup \
    -not -path '/opt/pagedserve/cache/startup/*')
  [ -z "$writable" ] || { echo "the executor may write: $writable"; return 1; }
  podman_ exec "$id" test -w /opt/pagedserve/cache/startup || { echo "its start-up cache is not writable"; return 1; }
  until text=$(compose logs --no-color executor 2>&1) && grep -q "kept for the next start\|not kept: " <<<"$text"; do
    [ $SECONDS -lt $deadline ] || { echo "the executor never measured its packing choice"; return 1; }
    sleep 1
  done
  if grep "not kept: \|start-up cache .* not written" <<<"$text"; then return 1; fi
  note "only the start-up cache is writable; $(grep -m1 -o "linear weights pack.*kept for the next start.*" <<<"$text")"
}

# started_from_cache NAME: the executor container NAME (its compose log prefix, executor_1) packed its linears as
# the start-up cache measured, instead of measuring again after ready.
started_from_cache() {
  local text line
  text=$(compose logs --no-color executor 2>&1)
  line=$(grep "^$1 " <<<"$text" | grep -o "linear weights .*(as the start-up cache measured)" || true)
  if [ -z "$line" ]; then
    echo "$1 did not start from the start-up cache:"
    grep -E "start-up cache|linear weights" <<<"$text" || true
    return 1
  fi
  note "$1: $(tail -n 1 <<<"$line")"
}

RESTART_ARGS=(--max-tokens "$RESTART_MAX_TOKENS" --temperature 0 --ignore-eos "The executor restarts while this streams")

# The undisturbed greedy run the restarted stream must equal, token for token.
reference_run() {
  local t0=$EPOCHREALTIME
  generate "${RESTART_ARGS[@]}" >"$WORK/reference.jsonl"
  note "$(awk -v a="$t0" -v b="$EPOCHREALTIME" -v n="$RESTART_MAX_TOKENS" \
    'BEGIN { printf "%d tokens in %.1fs", n, b - a }')"
}

# same_tokens FILE BEFORE ALIVE WHAT: the stream in FILE completed with the reference's tokens, and was still open
# (ALIVE) when WHAT went down with BEFORE messages received.
same_tokens() {
  "$PY" - "$WORK/reference.jsonl" "$@" <<'PYEOF' | tee "$WORK/note"
import json, sys
ref, got = ([json.loads(x) for x in open(p)] for p in sys.argv[1:3])
before, alive, what = sys.argv[3:6]
tokens = lambda msgs: [t for m in msgs for t in m["token_ids"]]
last = got[-1] if got else {}
if last.get("finish_reason") != "length":
    sys.exit(f"the stream did not complete across the restart: {last.get('finish_reason')}: {last.get('error')}")
if tokens(got) != tokens(ref):
    sys.exit("the restarted stream's tokens differ from the undisturbed run's")
if alive != "yes":
    sys.exit(f"the stream ended before {what} went down: raise RESTART_MAX_TOKENS")
print(f"{len(tokens(got))} tokens equal the undisturbed run; {before} messages had arrived when {what} went down")
PYEOF
}

# Start the same request, restart the executor container once tokens flow, and require the stream to be
# still open after the restart (so the executor went away under it) and to end with the reference tokens.
# The SIGTERM goes straight to podman at the first tokens: `compose restart` took longer than the whole 960-token
# stream on a loaded machine (the stream ended before the executor went down).
check_restart() {
  local id client alive=yes before
  id=$(container_of executor)
  [ -n "$id" ] || { echo "no executor container"; return 1; }
  "$PY" -m client generate --server "$SERVER" --json "${RESTART_ARGS[@]}" >"$WORK/restart.jsonl" 2>"$WORK/restart.err" &
  client=$!
  echo $client >"$WORK/client.pid"
  for _ in $(seq 600); do
    if [ -s "$WORK/restart.jsonl" ] || ! kill -0 $client 2>/dev/null; then break; fi
    sleep 0.05
  done
  before=$(wc -l <"$WORK/restart.jsonl")
  podman_ kill -s TERM "$id" >/dev/null
  kill -0 $client 2>/dev/null || alive=no
  compose start executor  # its restart policy brings it back (a no-op then); if it has not stopped yet, that will
  wait $client || true
  rm -f "$WORK/client.pid"
  same_tokens "$WORK/restart.jsonl" "$before" "$alive" "the executor"
  compose logs --no-color scheduler | grep "executor stream lost" || echo "note: no 'executor stream lost' line in the scheduler log"
}

# Data parallel: a second executor joins through compose's DNS (dns:///executor:50061), and requests sent
# at once are served by both (each executor's own step count in /metrics grows).
executor_metrics() {
  "$PY" - "http://127.0.0.1:$METRICS_PORT/metrics" "$1" <<'PYEOF'
import re, sys, urllib.request
text = urllib.request.urlopen(sys.argv[1], timeout=10).read().decode()
pattern = re.compile(r'^pagedserve:%s\{[^}]*executor="([^"]+)"[^}]*\} (\S+)$' % re.escape(sys.argv[2]), re.M)
for executor, value in pattern.findall(text):
    print(executor, value)
PYEOF
}

check_scale() {
  compose up -d --no-build --scale executor=2
  local deadline=$((SECONDS + 300)) i pids=()
  until [ "$(executor_metrics executor_serving | awk '$2 == 1' | wc -l)" -eq 2 ]; do
    [ $SECONDS -lt $deadline ] || { echo "two executors are not both serving"; executor_metrics executor_serving; return 1; }
    sleep 1
  done
  executor_metrics executor_step_seconds_count >"$WORK/steps.before"
  for i in $(seq 8); do
    "$PY" -m client generate --server "$SERVER" --json --max-tokens 64 --temperature 0 --ignore-eos "replica $i" \
      >"$WORK/scale.$i.jsonl" &
    pids+=($!)
  done
  for i in "${pids[@]}"; do wait "$i"; done
  [ "$(cat "$WORK"/scale.*.jsonl | grep -c '"finish_reason": "length"')" -eq 8 ] || { echo "not all 8 completed"; return 1; }
  executor_metrics executor_step_seconds_count >"$WORK/steps.after"
  awk 'FILENAME == ARGV[1] { before[$1] = $2; next } { d = $2 - before[$1]; n += d > 0; printf "%s +%d steps\n", $1, d }
       END { exit n != 2 }' "$WORK/steps.before" "$WORK/steps.after" | tee "$WORK/steps"
  note "8 requests served by both executors: $(awk '{ printf "%s ", $2 }' "$WORK/steps")"
}

compose_down() {
  stop_pid_file healthchecks
  compose logs --no-color --timestamps >"$WORK/containers.log" 2>&1
  compose down --timeout 10 --volumes --remove-orphans
}

# ------------------------------------------------------------------ the three tiers (compose.tiers.yaml)
tiers_up() {
  start_healthchecks
  timeout 600 "${TIERS[@]}" up -d --no-build
  note "executor, engine-core, frontend: grpc 127.0.0.1:$GRPC_PORT, metrics 127.0.0.1:$METRICS_PORT"
}

# SIGKILL one tier's container with a client-library stream in flight (--resume-attempts), start it again, and
# require the stream to end with the undisturbed run's tokens. The kill goes straight to podman, at the first
# tokens: the whole stream takes a few seconds undisturbed, less than a `compose restart` under load.
check_tier_restart() {
  local service=$1 id client alive=yes before out=$WORK/tier-$1.jsonl
  id=$(container_of "$service")
  [ -n "$id" ] || { echo "no $service container"; return 1; }
  "$PY" -m client generate --server "$SERVER" --json --resume-attempts 100 "${RESTART_ARGS[@]}" \
    >"$out" 2>"$out.err" &
  client=$!
  echo $client >"$WORK/client.pid"
  for _ in $(seq 600); do
    if [ -s "$out" ] || ! kill -0 $client 2>/dev/null; then break; fi
    sleep 0.05
  done
  before=$(wc -l <"$out")
  podman_ kill -s KILL "$id" >/dev/null
  kill -0 $client 2>/dev/null || alive=no
  "${TIERS[@]}" start "$service"
  wait $client || { cat "$out.err"; true; }
  rm -f "$WORK/client.pid"
  same_tokens "$out" "$before" "$alive" "$service"
}

check_core_resumed() {
  "${TIERS[@]}" logs --no-color frontend | grep -E "resumed [1-9][0-9]* requests|moved its [1-9][0-9]* open requests" | tee "$WORK/note"
}

tiers_down() {
  stop_pid_file healthchecks
  "${TIERS[@]}" logs --no-color --timestamps >"$WORK/tiers.log" 2>&1
  "${TIERS[@]}" down --timeout 10 --volumes --remove-orphans
}

# ------------------------------------------------------------------------------------------- cleanup
alive() { [ -d "/proc/$1" ] && ! grep -q '^State:[[:space:]]*Z' "/proc/$1/status" 2>/dev/null; }
stop_pid_file() {
  local f=$WORK/$1.pid pid
  [ -f "$f" ] || return 0
  pid=$(cat "$f")
  $SUDO kill "$pid" 2>/dev/null || true
  for _ in $(seq 100); do alive "$pid" || break; sleep 0.1; done
  $SUDO kill -9 "$pid" 2>/dev/null || true
  rm -f "$f"
}

cleanup() {
  local rc=$? left
  set +e
  stop_pid_file client
  stop_pid_file healthchecks
  if [ -S "$SOCK" ] && [ -n "$(podman_ ps -aq --filter "label=com.docker.compose.project=$PROJECT")" ]; then
    compose logs --no-color --timestamps >"$WORK/containers.log" 2>&1
    "${TIERS[@]}" logs --no-color --timestamps >"$WORK/tiers.log" 2>&1
    compose down --timeout 5 --volumes --remove-orphans >>"$LOG" 2>&1
  fi
  for c in $(podman_ ps -aq --filter "label=com.docker.compose.project=$PROJECT"); do podman_ rm -f "$c" >>"$LOG" 2>&1; done
  for n in $(podman_ network ls -q --filter "label=com.docker.compose.project=$PROJECT"); do podman_ network rm -f "$n" >>"$LOG" 2>&1; done
  stop_pid_file service
  left=$(podman_ ps -aq --filter "label=com.docker.compose.project=$PROJECT" | wc -l)
  left=$((left + $(podman_ network ls -q --filter "label=com.docker.compose.project=$PROJECT" | wc -l)))
  if [ "$rc" -eq 0 ] && [ "$left" -eq 0 ] && [ "$KEEP_LOGS" = off ]; then
    $SUDO rm -rf "$WORK"
  else
    log "logs kept in $WORK"
  fi
  [ "$left" -eq 0 ] || { log "cleanup left $left containers/networks of $PROJECT"; rc=1; }
  log "$(printf '%-26s %7ss  %s' "total" "$SECONDS" "$([ "$rc" -eq 0 ] && echo passed || echo FAILED)")"
  exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

# -------------------------------------------------------------------------------------------- main
stage "install packages" install_packages
stage "configure podman" configure_podman
stage "clear stale runs" clear_stale_runs
stage "base image" make_base_image
stage "build image" build_image
stage "podman API service" start_api_service
stage "compose up" compose_up
stage "wait healthy" wait_healthy 300
stage "generate" check_generate
stage "http api" check_http
stage "metrics" check_metrics
stage "cpu kernels" check_kernels
stage "reference greedy run" reference_run
stage "start-up cache kept" check_startup_cache_kept
stage "restart executor" check_restart
stage "healthy after restart" wait_healthy 120
stage "restart used the cache" started_from_cache executor_1
stage "scale executors" check_scale
stage "new replica used it" started_from_cache executor_2
stage "compose down" compose_down
stage "tiers up" tiers_up
stage "tiers healthy" wait_services 300 executor engine-core frontend
stage "restart engine-core" check_tier_restart engine-core
stage "front-end resumed" check_core_resumed
stage "tiers healthy again" wait_services 120 executor engine-core frontend
stage "restart frontend" check_tier_restart frontend
stage "tiers down" tiers_down
