#!/usr/bin/env bash
# A deployment CA and certificates for kvfabric, etcd and NATS, with openssl:
#
#   scripts/tls-certs.sh DIR NAME=SANS [NAME=SANS ...]
#   scripts/tls-certs.sh deploy/tls localhost=IP:127.0.0.1,DNS:localhost
#   scripts/tls-certs.sh /etc/kvfabric/tls h1=IP:10.0.0.11,DNS:h1 h2=IP:10.0.0.12,DNS:h2
#
# Writes DIR/ca.pem and DIR/ca.key (once: kept if present), then DIR/NAME.pem and
# DIR/NAME.key for each NAME not there yet: P-256 keys, valid DAYS (default 90) days, for
# servers and clients alike, the names in the subject alternative names only and no Common
# Name (etcd's HTTP gateway refuses client certificates that carry one while its
# authentication is on). A kvfabric process needs the addresses it advertises among its
# names. Keys are readable by their owner only. Renew by removing NAME.pem and running it
# again, then `kill -HUP` the process: it reloads its files without dropping connections.
set -euo pipefail
dir=${1:?usage: scripts/tls-certs.sh DIR NAME=SANS...}
shift
days=${DAYS:-90}
command -v openssl >/dev/null || { echo "tls-certs.sh: openssl is needed" >&2; exit 1; }
umask 077
mkdir -p "$dir"
if [ ! -f "$dir/ca.pem" ]; then
    openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes \
        -days $((days * 4)) -subj "/CN=kvfabric deployment CA" \
        -keyout "$dir/ca.key" -out "$dir/ca.pem" 2>/dev/null
fi
for spec in "$@"; do
    name=${spec%%=*}
    sans=${spec#*=}
    [[ $name =~ ^[A-Za-z0-9._-]+$ && $sans != "$spec" ]] || {
        echo "tls-certs.sh: $spec is not NAME=IP:a.b.c.d,DNS:name" >&2
        exit 1
    }
    [ -f "$dir/$name.pem" ] && continue
    openssl req -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes -subj "/" \
        -keyout "$dir/$name.key" -out "$dir/$name.csr" 2>/dev/null
    printf 'subjectAltName=%s\nextendedKeyUsage=serverAuth,clientAuth\n' "$sans" >"$dir/$name.ext"
    openssl x509 -req -in "$dir/$name.csr" -CA "$dir/ca.pem" -CAkey "$dir/ca.key" \
        -CAcreateserial -days "$days" -extfile "$dir/$name.ext" -out "$dir/$name.pem" 2>/dev/null
    rm -f "$dir/$name.csr" "$dir/$name.ext"
done
chmod 644 "$dir"/*.pem
