#!/usr/bin/env bash
# Hosts made of Linux namespaces, on this one machine, and a kvfabric deployment across them.
#
#   scripts/cluster.sh up                 16 hosts: etcd members on h1-h3, NATS servers
#                                         (JetStream, work queue R3) on h4-h6, frontends on h7,
#                                         h8, fabric nodes on h9, h10, workers w1-w4 on h11-h14,
#                                         a prefill/decode pair p1, d1 on h15, h16
#   scripts/cluster.sh down               every process, namespace, veth and shm segment gone
#   scripts/cluster.sh hosts N            N bare hosts (h1..hN), nothing running
#   scripts/cluster.sh exec HOST CMD...   run CMD on HOST (its network, hostname, pids, mounts)
#   scripts/cluster.sh start HOST NAME CMD...   run CMD on HOST in the background as NAME
#                                         (log: $DIR/logs/NAME.log)
#   scripts/cluster.sh stop NAME [SIGNAL] [SECONDS]   signal NAME (TERM), wait for it to end
#                                         (30 s), then KILL it
#   scripts/cluster.sh cut HOST | heal HOST   take HOST's link down (a partition) / up again
#   scripts/cluster.sh shape HOST RATE    shape HOST's link both ways (tbf: 1gbit, 10gbit,
#                                         25gbit; `off` removes it)
#   scripts/cluster.sh ip HOST            HOST's address
#   scripts/cluster.sh curl ARGS...       curl as this machine reaches the deployment (with
#                                         KVF_TLS: its CA, and the bridge's client certificate)
#   scripts/cluster.sh ps                 the processes started, where, and whether alive
#
# Each host has its own network namespace (a veth pair into one bridge, an address of its own in
# a private /24, the bridge as its gateway), its own UTS namespace (hostname hN), its own pid
# namespace (kvfabric's host identity is the boot id plus the pid namespace, so KV moves over
# TCP between hosts, never shm) and its own mount namespace with a private /dev/shm and its own
# data directory at /var/lib/kvfabric. The bridge has the /24's .1 address: this machine's own
# namespace reaches every host (curl, bench serve).
#
# What this kernel cannot emulate: it has no `netem` (no delay, jitter or loss), `fq` or `prio`
# qdiscs, and no iptables/nft. Links here have no latency beyond the kernel's; a cut is a link
# taken down (connection attempts time out; nothing is refused or reset). No RDMA device.
#
# Settings (environment):
#   KVF_CLUSTER   name prefix of namespaces and interfaces (default kvf; at most 6 characters)
#   KVF_SUBNET    the /24, as its first three octets (default 10.77.0): host hN is .(10+N)
#   KVF_DIR       state and logs (default /tmp/kvfabric-cluster-$KVF_CLUSTER)
#   KVFABRIC_BIN  the kvfabric binary (default: target/release/kvfabric, built if missing)
#   KVF_MODEL     a GGUF for the prefill/decode pair (default: scripts/fetch-model.sh's; `mock`:
#                 that pair runs the mock engine too, as the model `mock-pd`)
#   KVF_PD_ARGS   more flags for the mock prefill/decode pair (`--mock-kv full`: every KV byte)
#   KVF_WORKER_ARGS  more flags for w1-w4 (`--host-blocks 32 --disk-blocks 0`: their
#                 evictions go to the fabric nodes, and hits come back from them)
#   KVF_MOCK_ARGS  the mock engine's timing on w1-w4 (default `--mock-prefill-us 20
#                 --mock-decode-us 2000`)
#   KVF_REMOTE_TIER  `false`: workers do not use the fabric nodes as their G4 tier
#   KVF_FABRIC_ARGS  the fabric nodes' sizes (default `--host-blocks 2048 --disk-blocks 4096`)
#   KVF_FRONTEND_ARGS  more flags for the frontends (`--router round-robin`,
#                 `--router-pull-link 1g`)
#   KVF_LEASE_TTL_S  the workers' and fabric nodes' discovery lease (default 10)
#   KVF_ETCD_HOSTS, KVF_NATS_HOSTS  where the etcd members and NATS servers run (default
#                 "h1 h2 h3" and "h4 h5 h6")
#   KVF_ONE_HOST  set: `up` puts the same deployment on one host (h1), each process on ports
#                 of its own (the base port plus ten times its place in the layout), for the
#                 cost of crossing hosts to be a number
#   KVF_TLS       set: TLS on every port. A deployment CA (openssl, in $DIR/etc/tls) signs a
#                 certificate per host (its address and name, no Common Name); etcd serves
#                 clients and peers over TLS with client certificates required, and its
#                 authentication on (user root, password in $DIR/etc/etcd-password); NATS
#                 clients, routes and monitoring over TLS with client certificates verified,
#                 and a user and password ($DIR/etc/nats-password); every kvfabric process
#                 serves HTTPS (API, metrics) and mutual TLS between processes. Clients
#                 outside: scripts/cluster.sh curl ARGS (the CA and the bridge's certificate)
# Needs root (namespaces, veths), iproute2, util-linux (unshare, nsenter), etcd, nats-server.
set -euo pipefail

C=${KVF_CLUSTER:-kvf}
NET=${KVF_SUBNET:-10.77.0}
DIR=${KVF_DIR:-/tmp/kvfabric-cluster-$C}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
BR="$C-br"

die() { echo "cluster.sh: $*" >&2; exit 1; }
[ "${#C}" -le 6 ] || die "KVF_CLUSTER must be at most 6 characters (interface names)"

num() { local h=$1; [[ $h =~ ^h([0-9]+)$ ]] || die "no such host: $h (h1, h2, ...)"; echo "${BASH_REMATCH[1]}"; }
ipof() { echo "$NET.$((10 + $(num "$1")))"; }
init_pid() {
    local f="$DIR/$1/init.pid"
    [ -f "$f" ] && kill -0 "$(cat "$f")" 2>/dev/null || die "host $1 is not up"
    cat "$f"
}
# The first child of a process (nsenter and unshare fork into a new pid namespace).
child_of() {
    local p=$1 i
    for i in $(seq 1 200); do
        local c
        c=$(cat "/proc/$p/task/$p/children" 2>/dev/null | awk '{print $1}')
        [ -n "$c" ] && { echo "$c"; return 0; }
        kill -0 "$p" 2>/dev/null || return 1
        sleep 0.01
    done
    return 1
}

cmd_hosts() {
    local n=${1:?hosts N}
    [ "$(id -u)" = 0 ] || die "needs root (network, pid, UTS and mount namespaces)"
    for t in ip unshare nsenter tc; do command -v $t >/dev/null || die "$t not found"; done
    mkdir -p "$DIR/logs" "$DIR/pids"
    if ! ip link show "$BR" >/dev/null 2>&1; then
        ip link add "$BR" type bridge
        ip addr add "$NET.1/24" dev "$BR"
        ip link set "$BR" up
    fi
    local i
    for i in $(seq 1 "$n"); do
        local h="h$i" ns="$C-h$i" v="$C-v$i" addr
        addr=$(ipof "$h")
        [ -f "$DIR/$h/init.pid" ] && kill -0 "$(cat "$DIR/$h/init.pid")" 2>/dev/null && continue
        ip netns add "$ns"
        ip link add "$v" type veth peer name eth0 netns "$ns"
        ip link set "$v" master "$BR" up
        ip netns exec "$ns" ip link set lo up
        ip netns exec "$ns" ip addr add "$addr/24" dev eth0
        ip netns exec "$ns" ip link set eth0 up
        ip netns exec "$ns" ip route add default via "$NET.1"
        mkdir -p "$DIR/$h/data" /var/lib/kvfabric
        # The host's init: pid 1 of its pid namespace, holding its hostname and mounts; it
        # reaps what is left to it, and everything in the namespace dies with it.
        setsid ip netns exec "$ns" unshare --pid --fork --uts --mount --mount-proc \
            --propagation private bash -c "
                hostname $h
                mount -t tmpfs -o size=4g tmpfs /dev/shm
                mount --bind '$DIR/$h/data' /var/lib/kvfabric
                trap 'exit 0' TERM
                while :; do sleep 3600 & wait; done" </dev/null >"$DIR/$h/init.log" 2>&1 &
        local init
        init=$(child_of $!) || die "host $h did not start: $(cat "$DIR/$h/init.log")"
        echo "$init" >"$DIR/$h/init.pid"
    done
    # Ready when every host's mounts are in place.
    for i in $(seq 1 "$n"); do
        local k
        for k in $(seq 1 100); do
            cmd_exec "h$i" mountpoint -q /var/lib/kvfabric 2>/dev/null && break
            sleep 0.05
        done
    done
}

cmd_exec() {
    local h=$1; shift
    nsenter -t "$(init_pid "$h")" --net --uts --pid --mount -- "$@"
}

cmd_start() {
    local h=$1 name=$2; shift 2
    [[ $name =~ ^[A-Za-z0-9._-]+$ ]] || die "bad name $name"
    local init
    init=$(init_pid "$h")
    mkdir -p "$DIR/logs" "$DIR/pids"
    # Its own session: a signal to this script's group does not reach it.
    setsid nsenter -t "$init" --net --uts --pid --mount -- "$@" \
        </dev/null >>"$DIR/logs/$name.log" 2>&1 &
    local pid
    pid=$(child_of $!) || die "$name did not start on $h: $(tail -5 "$DIR/logs/$name.log")"
    echo "$pid $h" >"$DIR/pids/$name"
    echo "$pid"
}

cmd_stop() {
    local name=$1 sig=${2:-TERM} secs=${3:-30}
    local f="$DIR/pids/$name"
    [ -f "$f" ] || die "no process $name"
    local pid
    pid=$(awk '{print $1}' "$f")
    kill -s "$sig" "$pid" 2>/dev/null || true
    local k
    for k in $(seq 1 $((secs * 20))); do
        kill -0 "$pid" 2>/dev/null || { rm -f "$f"; return 0; }
        # A zombie (its host's init reaps it) is gone.
        [ "$(awk '{print $3}' "/proc/$pid/stat" 2>/dev/null)" = Z ] && { rm -f "$f"; return 0; }
        sleep 0.05
    done
    kill -KILL "$pid" 2>/dev/null || true
    rm -f "$f"
}

cmd_cut() { ip link set "$C-v$(num "$1")" down; }
cmd_heal() { ip link set "$C-v$(num "$1")" up; }

cmd_shape() {
    local h=$1 rate=${2:?shape HOST RATE}
    local v="$C-v$(num "$h")" ns="$C-$h"
    if [ "$rate" = off ]; then
        tc qdisc del dev "$v" root 2>/dev/null || true
        ip netns exec "$ns" tc qdisc del dev eth0 root 2>/dev/null || true
        return
    fi
    [[ $rate =~ ^([0-9]+)(gbit|mbit)$ ]] || die "rate like 1gbit, 10gbit, 25gbit, 500mbit"
    local unit=125000
    [ "${BASH_REMATCH[2]}" = gbit ] && unit=125000000
    local bytes_s=$((BASH_REMATCH[1] * unit))
    # A bucket of 4 ms at the rate (at least 128 KiB): tbf needs one timer tick's worth.
    local burst=$((bytes_s / 250 > 131072 ? bytes_s / 250 : 131072))
    # What the bridge sends to the host, and what the host sends.
    tc qdisc replace dev "$v" root tbf rate "$rate" burst "$burst" latency 50ms
    ip netns exec "$ns" tc qdisc replace dev eth0 root tbf rate "$rate" burst "$burst" latency 50ms
}

cmd_ps() {
    local f
    for f in "$DIR"/pids/*; do
        [ -f "$f" ] || continue
        local pid h
        read -r pid h <"$f"
        if kill -0 "$pid" 2>/dev/null; then s=alive; else s=gone; fi
        printf '%-12s %-4s %-8s %s\n' "$(basename "$f")" "$h" "$pid" "$s"
    done
}

cmd_down() {
    local f
    # Every host's init, and with it everything in its pid namespace.
    for f in "$DIR"/h*/init.pid; do
        [ -f "$f" ] && kill -KILL "$(cat "$f")" 2>/dev/null || true
    done
    for f in "$DIR"/pids/*; do
        [ -f "$f" ] && kill -KILL "$(awk '{print $1}' "$f")" 2>/dev/null || true
        rm -f "$f"
    done
    local ns
    for ns in $(ip netns list 2>/dev/null | awk '{print $1}' | grep "^$C-h" || true); do
        ip netns pids "$ns" 2>/dev/null | xargs -r kill -KILL 2>/dev/null || true
        ip netns del "$ns" 2>/dev/null || true
    done
    local l
    for l in $(ip -o link show 2>/dev/null | awk -F': ' '{print $2}' | cut -d@ -f1 | grep "^$C-" || true); do
        ip link del "$l" 2>/dev/null || true
    done
    rm -rf "$DIR"/h*/ "$DIR/pids" "$DIR/etc"
    # Logs stay, for whoever looks at what happened.
}

# --- the deployment -------------------------------------------------------------------------

binary() {
    if [ -n "${KVFABRIC_BIN:-}" ]; then echo "$KVFABRIC_BIN"; return; fi
    local b="${CARGO_TARGET_DIR:-$ROOT/target}/release/kvfabric"
    [ -x "$b" ] || (cd "$ROOT" && cargo build --release -p kvfabric-cli >&2)
    echo "$b"
}

# curl as this machine's clients reach the deployment (with KVF_TLS: trusting its CA and
# presenting the client certificate of the bridge's address).
curl_() {
    if [ -n "${KVF_TLS:-}" ]; then
        curl --cacert "$DIR/etc/tls/ca.pem" --cert "$DIR/etc/tls/bridge.pem" \
            --key "$DIR/etc/tls/bridge.key" "$@"
    else
        curl "$@"
    fi
}
# http, or https with KVF_TLS.
scheme() { if [ -n "${KVF_TLS:-}" ]; then echo https; else echo http; fi; }

wait_http() {
    local url=$1 what=$2 secs=${3:-60} k
    for k in $(seq 1 $((secs * 4))); do
        curl_ -fsS -m 1 "$url" >/dev/null 2>&1 && return 0
        sleep 0.25
    done
    die "$what did not answer at $url within ${secs}s (logs: $DIR/logs)"
}

# The endpoints every kvfabric process is given.
etcd_endpoints() {
    local s
    s=$(scheme)
    echo "$s://$(ipn etcd-1):$(port etcd-1 2379),$s://$(ipn etcd-2):$(port etcd-2 2379),$s://$(ipn etcd-3):$(port etcd-3 2379)"
}
nats_urls() {
    echo "nats://$(ipn nats-1):$(port nats-1 4222),nats://$(ipn nats-2):$(port nats-2 4222),nats://$(ipn nats-3):$(port nats-3 4222)"
}
# The address of the host NAME runs on, in the layout.
ipn() { ipof "$(host_of "$1")"; }
# The port BASE of NAME: BASE itself, or with KVF_ONE_HOST (every process on h1) BASE plus
# ten times NAME's place in the layout.
port() {
    local name=$1 base=$2
    if [ -z "${KVF_ONE_HOST:-}" ]; then echo "$base"; return; fi
    local k
    k=$(layout | awk -v n="$name" '$1 == n {print NR - 1}')
    echo $((base + 10 * k))
}

start_etcd() {
    local i=$1 state=${2:-new}
    local ip h
    h=$(host_of "etcd-$i")
    ip=$(ipof "$h")
    local c p s tls=()
    c=$(port "etcd-$i" 2379)
    p=$(port "etcd-$i" 2380)
    s=$(scheme)
    if [ -n "${KVF_TLS:-}" ]; then
        local t="$DIR/etc/tls"
        tls=(--cert-file "$t/$h.pem" --key-file "$t/$h.key" --client-cert-auth
            --trusted-ca-file "$t/ca.pem" --peer-cert-file "$t/$h.pem" --peer-key-file "$t/$h.key"
            --peer-client-cert-auth --peer-trusted-ca-file "$t/ca.pem")
    fi
    start_on "$h" "etcd-$i" etcd --name "e$i" --data-dir "/var/lib/kvfabric/etcd-$i" \
        --listen-client-urls "$s://$ip:$c" --advertise-client-urls "$s://$ip:$c" \
        --listen-peer-urls "$s://$ip:$p" --initial-advertise-peer-urls "$s://$ip:$p" \
        --initial-cluster "e1=$s://$(ipn etcd-1):$(port etcd-1 2380),e2=$s://$(ipn etcd-2):$(port etcd-2 2380),e3=$s://$(ipn etcd-3):$(port etcd-3 2380)" \
        --initial-cluster-state "$state" --initial-cluster-token "$C-etcd" "${tls[@]}"
}

start_nats() {
    local i=$1 ip h
    h=$(host_of "nats-$i")
    ip=$(ipof "$h")
    mkdir -p "$DIR/etc"
    local monitor="http: $ip:$(port "nats-$i" 8222)" tls="" auth=""
    if [ -n "${KVF_TLS:-}" ]; then
        local t="$DIR/etc/tls"
        monitor="https: $ip:$(port "nats-$i" 8222)"
        tls="tls { cert_file: \"$t/$h.pem\", key_file: \"$t/$h.key\", ca_file: \"$t/ca.pem\", verify: true, timeout: 2 }"
        auth="authorization { user: kvfabric, password: \"$(cat "$DIR/etc/nats-password")\" }"
    fi
    (umask 077; cat >"$DIR/etc/nats-$i.conf" <<EOF
server_name: n$i
listen: $ip:$(port "nats-$i" 4222)
$monitor
$tls
$auth
jetstream { store_dir: /var/lib/kvfabric/nats-$i, max_memory_store: 256MB, max_file_store: 2GB }
cluster {
  name: $C
  listen: $ip:$(port "nats-$i" 6222)
  routes: [nats://$(ipn nats-1):$(port nats-1 6222), nats://$(ipn nats-2):$(port nats-2 6222), nats://$(ipn nats-3):$(port nats-3 6222)]
  $tls
}
EOF
    )
    start_on "$h" "nats-$i" nats-server -c "$DIR/etc/nats-$i.conf"
}

start_on() { cmd_start "$@" >/dev/null; }

# Environment of every kvfabric process on host $1.
kv_env() {
    local h=$1
    echo "KVFABRIC_ETCD=$(etcd_endpoints)" "KVFABRIC_NATS=$(nats_urls)" \
        "KVFABRIC_SECRET_FILE=$DIR/etc/secret" "KVFABRIC_LOG_LEVEL=${KVF_LOG_LEVEL:-info}"
    if [ -n "${KVF_TLS:-}" ]; then
        local t="$DIR/etc/tls"
        echo "KVFABRIC_TLS_CERT=$t/$h.pem" "KVFABRIC_TLS_KEY=$t/$h.key" "KVFABRIC_TLS_CA=$t/ca.pem" \
            "KVFABRIC_ETCD_CA=$t/ca.pem" "KVFABRIC_ETCD_CERT=$t/$h.pem" "KVFABRIC_ETCD_KEY=$t/$h.key" \
            "KVFABRIC_ETCD_USER=root" "KVFABRIC_ETCD_PASSWORD_FILE=$DIR/etc/etcd-password" \
            "KVFABRIC_NATS_CA=$t/ca.pem" "KVFABRIC_NATS_CERT=$t/$h.pem" "KVFABRIC_NATS_KEY=$t/$h.key" \
            "KVFABRIC_NATS_USER=kvfabric" "KVFABRIC_NATS_PASSWORD_FILE=$DIR/etc/nats-password"
    fi
}

# KVF_TLS: the deployment CA, a certificate per host (its address and hostname as subject
# alternative names, no Common Name: etcd's gateway refuses client certificates with one
# while its authentication is on) and one for the bridge (this machine's own clients); the
# passwords of etcd and NATS. Kept across `up`s (`down` removes $DIR/etc).
tls_init() {
    local t="$DIR/etc/tls" n=$1 i
    mkdir -p "$t"
    (
        umask 077
        [ -f "$DIR/etc/etcd-password" ] || head -c 18 /dev/urandom | base64 | tr -d '/+=' >"$DIR/etc/etcd-password"
        [ -f "$DIR/etc/nats-password" ] || head -c 18 /dev/urandom | base64 | tr -d '/+=' >"$DIR/etc/nats-password"
    )
    local specs=("bridge=IP:$NET.1")
    for i in $(seq 1 "$n"); do specs+=("h$i=IP:$(ipof "h$i"),DNS:h$i"); done
    DAYS=30 "$ROOT/scripts/tls-certs.sh" "$t" "${specs[@]}"
}

# KVF_TLS: etcd's authentication on, with the user root (what `etcdctl user add root` and
# `etcdctl auth enable` do, over the gateway).
etcd_auth() {
    local e="https://$(ipn etcd-1):$(port etcd-1 2379)" pw status
    pw=$(cat "$DIR/etc/etcd-password")
    status=$(curl_ -sS -m 5 -X POST "$e/v3/auth/status" -d '{}' || true)
    case "$status" in *'"enabled":true'*) return 0 ;; esac
    curl_ -fsS -m 5 -X POST "$e/v3/auth/user/add" -d "{\"name\":\"root\",\"password\":\"$pw\"}" >/dev/null
    curl_ -fsS -m 5 -X POST "$e/v3/auth/user/grant" -d '{"user":"root","role":"root"}' >/dev/null
    curl_ -fsS -m 5 -X POST "$e/v3/auth/enable" -d '{}' >/dev/null
}

start_fabric() {
    local h=$1 name=$2 bin
    shift 2
    bin=$(binary)
    # shellcheck disable=SC2046
    start_on "$h" "$name" env $(kv_env "$h") "$bin" fabric --name "$name" \
        --listen "$(ipof "$h"):$(port "$name" 7200)" \
        --dtype f32 ${KVF_FABRIC_ARGS:---host-blocks 2048 --disk-blocks 4096} --data-dir /var/lib/kvfabric \
        --lease-ttl-s "${KVF_LEASE_TTL_S:-10}" --metrics-listen "0.0.0.0:$(port "$name" 9100)" "$@"
}

# start_worker HOST NAME ROLE ENGINE-ARGS...
start_worker() {
    local h=$1 name=$2 role=$3 bin; shift 3
    bin=$(binary)
    # shellcheck disable=SC2046
    start_on "$h" "$name" env $(kv_env "$h") "$bin" worker --name "$name" --role "$role" \
        --listen "0.0.0.0:$(port "$name" 7100)" --metrics-listen "0.0.0.0:$(port "$name" 9100)" \
        --data-dir /var/lib/kvfabric \
        --remote-tier "${KVF_REMOTE_TIER:-true}" --drain-timeout-s 30 --lease-ttl-s "${KVF_LEASE_TTL_S:-10}" "$@"
}

start_frontend() {
    local h=$1 name=$2 bin
    shift 2
    bin=$(binary)
    # shellcheck disable=SC2046
    start_on "$h" "$name" env $(kv_env "$h") "$bin" frontend --name "$name" --host "$(ipof "$h")" \
        --port "$(port "$name" 8000)" ${KVF_FRONTEND_ARGS:-} "$@"
}

# What runs where in `up`: NAME HOST.
layout() {
    cat <<EOF
etcd-1 h1
etcd-2 h2
etcd-3 h3
nats-1 h4
nats-2 h5
nats-3 h6
frontend-1 h7
frontend-2 h8
fabric-1 h9
fabric-2 h10
w1 h11
w2 h12
w3 h13
w4 h14
p1 h15
d1 h16
EOF
}
host_of() {
    local n=$1
    if [ -n "${KVF_ONE_HOST:-}" ]; then echo h1; return; fi
    case "$n" in
        etcd-[123]) echo "${KVF_ETCD_HOSTS:-h1 h2 h3}" | awk -v i="${n#etcd-}" '{print $i}' ;;
        nats-[123]) echo "${KVF_NATS_HOSTS:-h4 h5 h6}" | awk -v i="${n#nats-}" '{print $i}' ;;
        *) layout | awk -v n="$n" '$1 == n {print $2}' ;;
    esac
}

# restart NAME: starts NAME of the layout again where it ran (after a stop or a kill).
cmd_restart() {
    local name=$1 h
    h=$(host_of "$name")
    [ -n "$h" ] || die "$name is not in the layout"
    # shellcheck disable=SC2046
    case "$name" in
        etcd-*) start_etcd "${name#etcd-}" existing ;;
        nats-*) start_nats "${name#nats-}" ;;
        frontend-*) start_frontend "$h" "$name" ;;
        fabric-*) start_fabric "$h" "$name" ;;
        w*) start_worker "$h" "$name" aggregated $(mock_args) ;;
        p*) start_worker "$h" "$name" prefill $(model_args) ;;
        d*) start_worker "$h" "$name" decode $(model_args) ;;
    esac
}

mock_args() { echo --engine mock --served-model-name mock ${KVF_MOCK_ARGS:---mock-prefill-us 20 --mock-decode-us 2000} ${KVF_WORKER_ARGS:-}; }

model_args() {
    local model=${KVF_MODEL:-}
    if [ "$model" = mock ]; then
        echo --engine mock --served-model-name mock-pd --mock-prefill-us 20 --mock-decode-us 2000 --prefill-threshold 32 ${KVF_PD_ARGS:-}
        return
    fi
    if [ -z "$model" ]; then
        local fetched
        fetched=$("$ROOT/scripts/fetch-model.sh" 2>/dev/null || true)
        [ -n "$fetched" ] && [ -f "$fetched" ] && model=$fetched
    fi
    if [ -n "$model" ]; then
        echo --engine llama --model "$model" --weights f32 --prefill-threshold 32
    else
        die "no model for the prefill/decode pair (scripts/fetch-model.sh failed): KVF_MODEL=mock runs the mock engine"
    fi
}

cmd_up() {
    command -v etcd >/dev/null && command -v nats-server >/dev/null || \
        die "etcd and nats-server are needed (scripts/setup.sh installs them)"
    command -v curl >/dev/null || die "curl is needed"
    binary >/dev/null
    model_args >/dev/null
    local n=16
    [ -n "${KVF_ONE_HOST:-}" ] && n=1
    cmd_hosts "$n"
    mkdir -p "$DIR/etc"
    [ -f "$DIR/etc/secret" ] || (umask 077; head -c 24 /dev/urandom | base64 >"$DIR/etc/secret")
    if [ -n "${KVF_TLS:-}" ]; then tls_init "$n"; fi
    local i name s
    s=$(scheme)
    for i in 1 2 3; do start_etcd $i; start_nats $i; done
    for i in 1 2 3; do
        wait_http "$s://$(ipn etcd-$i):$(port etcd-$i 2379)/health" "etcd-$i"
        wait_http "$s://$(ipn nats-$i):$(port nats-$i 8222)/healthz?js-enabled-only=true" "nats-$i"
    done
    if [ -n "${KVF_TLS:-}" ]; then etcd_auth; fi
    for name in fabric-1 fabric-2 w1 w2 w3 w4 p1 d1 frontend-1 frontend-2; do
        cmd_restart "$name"
    done
    wait_http "$s://$(ipn frontend-1):$(port frontend-1 8000)/health" frontend-1 120
    wait_http "$s://$(ipn frontend-2):$(port frontend-2 8000)/health" frontend-2 120
    for name in fabric-1 fabric-2 w1 w2 w3 w4 p1 d1; do
        wait_http "$s://$(ipn $name):$(port $name 9100)/health" "$name" 300
    done
    echo "kvfabric on $n hosts (logs: $DIR/logs; scripts/cluster.sh ps):"
    echo "  API:       $s://$(ipn frontend-1):$(port frontend-1 8000)/v1  (and $s://$(ipn frontend-2):$(port frontend-2 8000)/v1)"
    if [ -n "${KVF_TLS:-}" ]; then
        echo "  TLS:       every port (CA: $DIR/etc/tls/ca.pem; scripts/cluster.sh curl reaches it)"
    fi
    echo "  etcd:      $(etcd_endpoints)"
    echo "  NATS:      $(nats_urls)  (JetStream; the work queue has 3 replicas)"
    echo "  fabric:    fabric-1 on $(host_of fabric-1), fabric-2 on $(host_of fabric-2)"
    echo "  workers:   w1..w4 on $(host_of w1)..$(host_of w4) (mock), p1 (prefill) on $(host_of p1) -> d1 (decode) on $(host_of d1)"
}

verb=${1:-}
[ $# -gt 0 ] && shift
case "$verb" in
    up) cmd_up "$@" ;;
    down) cmd_down ;;
    hosts) cmd_hosts "$@" ;;
    exec) cmd_exec "$@" ;;
    start) cmd_start "$@" ;;
    stop) cmd_stop "$@" ;;
    cut) cmd_cut "$@" ;;
    heal) cmd_heal "$@" ;;
    shape) cmd_shape "$@" ;;
    ip) ipof "$@" ;;
    curl) curl_ "$@" ;;
    ps) cmd_ps ;;
    restart) cmd_restart "$@" ;;
    host-of) host_of "$@" ;;
    port) port "$@" ;;
    start-etcd) start_etcd "$@" ;;
    start-nats) start_nats "$@" ;;
    start-worker) start_worker "$@" ;;
    start-fabric) start_fabric "$@" ;;
    start-frontend) start_frontend "$@" ;;
    *) sed -n '2,/^set -euo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'; exit 2 ;;
esac
