#!/usr/bin/env bash
# The container image and the compose deployment, end to end on this machine (not part of CI:
# it installs podman and builds images; docs/deploy.md has its timings):
# 1. podman, runc and mmdebstrap from Debian's packages, when missing;
# 2. the base image the Dockerfile names (debian:bookworm-slim), made from Debian's packages
#    with mmdebstrap and imported under that name, when no such image is present (these
#    machines reach no image registry);
# 3. the wheel, built here (scripts/build-wheel.sh), and the image from it: the Dockerfile's
#    `runtime-prebuilt` target. Its `build` stage (a Rust toolchain image) is the one part not
#    run here: no toolchain image is reachable, and Debian 12's rustc is too old;
# 4. the etcd and NATS images (targets etcd and nats, Debian's packages);
# 5. deploy/compose.yaml up (one `podman run` per service, see below), on ports of its own,
#    a fresh secret; a chat
#    completion through the frontend, twice (the second reuses the first's KV); the
#    dashboard's numbers; every container's health; then down.
# podman runs here with runc, cgroupfs, explicit ulimits and host networking (../shared/ops.md),
# set through a containers.conf of this run (CONTAINERS_CONF).
#   KEEP=1      leave the deployment running
#   WHEEL=FILE  put this wheel (scripts/build-wheel.sh's) in the image instead of building one
set -euo pipefail
cd "$(dirname "$0")/.."
repo="$PWD"
t0=$(date +%s)
step() { echo "== $(( $(date +%s) - t0 )) s: $*" >&2; }

need=()
command -v podman >/dev/null || need+=(podman)
command -v runc >/dev/null || need+=(runc)
command -v mmdebstrap >/dev/null || need+=(mmdebstrap)
if [ ${#need[@]} -gt 0 ]; then
  step "installing ${need[*]}"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
fi

work="$(mktemp -d /tmp/kvfabric-container.XXXXXX)"
# Limits within this shell's hard ones (podman's defaults exceed them here).
limit() { local n; n=$(ulimit "-H$1"); [ "$n" = unlimited ] || [ "$n" -gt "$2" ] && n=$2; echo "$n"; }
nofile=$(limit n 16384) nproc=$(limit u 4096)
cat > "$work/containers.conf" <<CONF
[containers]
default_ulimits = ["nofile=$nofile:$nofile", "nproc=$nproc:$nproc"]
[engine]
runtime = "runc"
cgroup_manager = "cgroupfs"
events_logger = "file"
CONF
export CONTAINERS_CONF="$work/containers.conf"

base=docker.io/library/debian:bookworm-slim
if ! podman image exists "$base"; then
  step "making $base from Debian's packages (mmdebstrap)"
  mmdebstrap --quiet --variant=minbase --include=ca-certificates bookworm "$work/rootfs.tar"
  podman import --quiet "$work/rootfs.tar" "$base" >/dev/null
  rm -f "$work/rootfs.tar"
fi

rm -rf dist
if [ -n "${WHEEL:-}" ]; then
  mkdir -p dist && cp "$WHEEL" dist/
else
  step "building the wheel (release)"
  PROFILE=release scripts/build-wheel.sh >/dev/null
fi
ls -l dist/

step "building the images"
build() { podman build --quiet --network host --target "$1" -t "$2" . >/dev/null; }
build runtime-prebuilt localhost/kvfabric:latest
build etcd localhost/kvfabric-etcd:latest
build nats localhost/kvfabric-nats:latest
podman images --format '{{.Repository}}:{{.Tag}} {{.Size}}' | grep -E 'kvfabric|debian'

# Ports of this run's own, away from the defaults.
export KVFABRIC_PORT=18000 ETCD_PORT=12379 ETCD_PEER_PORT=12380 NATS_PORT=14222 \
  NATS_MONITOR_PORT=18222 WORKER_A_METRICS=19101 WORKER_B_METRICS=19102 FABRIC_METRICS=19110
KVFABRIC_MODEL_DIR="$(dirname "$(scripts/fetch-model.sh)")"
export KVFABRIC_MODEL_DIR
export KVFABRIC_SECRET_PATH="$work/secret"
head -c 32 /dev/urandom | base64 > "$KVFABRIC_SECRET_PATH"
# The compose file, run with plain `podman run`: Debian 12's podman-compose (1.0.3) adds a
# bridge network to every container, which podman refuses beside `network_mode: host`. This
# reads the compose features deploy/compose.yaml uses (images, commands, environment with
# ${VAR:-default}, bind and named volumes, file secrets, health checks, host networking,
# restart, depends_on order) and prints one `podman run` per service.
project=kvfabric-test
runs() {
  python3 - "$project" deploy/compose.yaml <<'PY'
import os, re, shlex, sys, yaml
project, path = sys.argv[1], sys.argv[2]
here = os.path.dirname(os.path.abspath(path))
def interp(v):
    if isinstance(v, str):
        v = re.sub(r"\$\{(\w+)(?::-([^}]*))?\}", lambda m: os.environ.get(m[1]) or (m[2] or ""), v)
        return v
    if isinstance(v, list):
        return [interp(x) for x in v]
    if isinstance(v, dict):
        return {k: interp(x) for k, x in v.items()}
    return v
doc = interp(yaml.safe_load(open(path)))
secrets = doc.get("secrets", {})
services, order = doc["services"], []
def visit(name):
    if name in order:
        return
    for dep in services[name].get("depends_on", []):
        visit(dep)
    order.append(name)
for name in services:
    visit(name)
for name in order:
    svc = services[name]
    cnt = f"{project}_{name}"
    args = ["podman", "run", "-d", "--name", cnt, "--label", f"io.podman.compose.project={project}",
            "--network", svc.get("network_mode", "host")]
    if svc.get("restart"):
        args += ["--restart", {"unless-stopped": "always"}.get(svc["restart"], svc["restart"])]
    for k, v in (svc.get("environment") or {}).items():
        args += ["-e", f"{k}={v}"]
    for vol in svc.get("volumes", []):
        src, dst, *mode = vol.split(":")
        if src.startswith(("/", ".", "~")):
            src = os.path.abspath(os.path.join(here, os.path.expanduser(src)))
        else:
            src = f"{project}_{src}"
        args += ["-v", ":".join([src, dst] + mode)]
    for sec in svc.get("secrets", []):
        f = os.path.abspath(os.path.join(here, os.path.expanduser(secrets[sec]["file"])))
        args += ["-v", f"{f}:/run/secrets/{sec}:ro"]
    hc = svc.get("healthcheck")
    if hc:
        test = hc["test"]
        cmd = shlex.join(test[1:]) if test[0] == "CMD" else test[1]
        args += ["--health-cmd", cmd, "--health-interval", hc.get("interval", "30s"),
                 "--health-timeout", hc.get("timeout", "30s"),
                 "--health-retries", str(hc.get("retries", 3))]
    args.append(svc["image"])
    command = svc.get("command", [])
    args += command if isinstance(command, list) else shlex.split(command)
    print(shlex.join(args))
PY
}
containers() { podman ps -a --filter "label=io.podman.compose.project=$project" --format '{{.Names}}'; }
down() {
  if [ -z "${KEEP:-}" ]; then
    for c in $(containers); do podman rm -f "$c" >/dev/null 2>&1 || true; done
    podman volume ls --format '{{.Name}}' | grep "^${project}_" | xargs -r podman volume rm -f >/dev/null 2>&1 || true
    rm -rf "$work"
  fi
}
trap down EXIT

step "compose up (podman run per service)"
# Without systemd, podman cannot arm its health-check timers (it says so per container); the
# checks still run on demand, as below.
runs | while read -r line; do eval "$line" 2>&1 >/dev/null | grep -v 'systemd connection' >&2 || true; done
fe="http://127.0.0.1:$KVFABRIC_PORT"
for _ in $(seq 300); do
  workers=$(curl -sf "$fe/health" 2>/dev/null | python3 -c 'import json,sys; print(len(json.load(sys.stdin).get("routing", {}).get("workers", [])))' 2>/dev/null || echo 0)
  [ "$workers" = 2 ] && break
  sleep 1
done
[ "$workers" = 2 ] || {
  for c in $(containers); do echo "--- $c" >&2; podman logs --tail 20 "$c" >&2; done
  echo "the frontend never saw both workers" >&2; exit 1; }
step "up: the frontend sees both workers"

ask() {
  curl -sf "$fe/v1/chat/completions" -H 'content-type: application/json' -d '{
    "model": "SmolLM2-135M-Instruct.Q4_1", "temperature": 0, "max_tokens": 24,
    "messages": [{"role": "system", "content": "You are a helpful assistant. Answer briefly and precisely, in one sentence."},
                 {"role": "user", "content": "What is the capital of France?"}]}'
}
for i in 1 2; do
  s=$(date +%s.%N)
  out="$(ask)"
  e=$(date +%s.%N)
  echo "$out" | python3 -c '
import json, sys
r = json.load(sys.stdin)
print("answer:", repr(r["choices"][0]["message"]["content"]))
print("usage:", json.dumps(r["usage"]))' 
  echo "request $i took $(python3 -c "print(f'{$e - $s:.2f}')") s"
done

step "the dashboard's view"
curl -sf "$fe/dashboard/state" | python3 -c '
import json, sys
d = json.load(sys.stdin)
print("server:", d["server"])
r = d["requests"]
print("requests: ok", r["ok"], "prompt tokens", r["prompt_tokens"], "from cache", r["cached_prompt_tokens"])
for w in d["workers"]:
    print("worker", w.get("name"), w.get("state"), "requests", w.get("requests"))
for t in d["tiers"]:
    print("tier", t["tier"], "used", t["used_blocks"], "of", t["capacity_blocks"], "hit tokens", t["hit_tokens"])'

step "health of every container"
podman ps --filter "label=io.podman.compose.project=$project" --format '{{.Names}} {{.Status}}'
# A container becomes healthy in its own time (the fabric node allocates its 3 GB host tier
# first, 8 s here): each check is retried for up to 60 s, as the compose file's retries allow,
# before the container counts as unhealthy.
for c in $(containers); do
  healthy=""
  for _ in $(seq 30); do
    podman healthcheck run "$c" >/dev/null 2>&1 && { healthy=1; break; }
    sleep 2
  done
  [ -n "$healthy" ] && echo "$c healthy" || {
    podman logs --tail 20 "$c" >&2; echo "$c unhealthy after 60 s of checks" >&2; exit 1; }
done
for port in "$WORKER_A_METRICS" "$WORKER_B_METRICS" "$FABRIC_METRICS"; do
  status=""
  for _ in $(seq 30); do
    status=$(curl -s "http://127.0.0.1:$port/health" | python3 -c 'import json,sys; print(json.load(sys.stdin)["status"])' 2>/dev/null) && [ "$status" = ok ] && break
    sleep 2
  done
  echo "127.0.0.1:$port /health: ${status:-no answer}"
done
step "done"
