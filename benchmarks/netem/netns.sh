#!/usr/bin/env bash
# Emulated multi-host network built from Linux network namespaces.
#
#   netns.sh up HOSTS RATE    build fr-sw (bridge br0) + fr-h0..fr-h{HOSTS-1}
#   netns.sh down             kill everything inside fr-* namespaces, delete them
#   netns.sh status           show namespaces, addresses and qdiscs
#
# Host i gets 10.77.0.(10+i)/24 on its interface fr-eth{i}; the switch side of
# the veth pair is fr-sp{i} (a port of br0 in fr-sw).  A tbf qdisc with RATE is
# put on BOTH ends of every veth, so each host has a RATE link to the switch in
# each direction.  No default route; addresses exist only inside the namespaces.
#
# Everything this script creates is named fr-*; `down` only touches fr-* names.
set -euo pipefail

PREFIX="fr-"
SW="${PREFIX}sw"
BR="br0"
SUBNET="10.77.0"
BASE=10
# tbf parameters (this kernel has no netem; latency 5ms caused drops, 25ms is fine)
TBF_BURST="${FR_TBF_BURST:-256kb}"
TBF_LATENCY="${FR_TBF_LATENCY:-25ms}"

die() { echo "netns.sh: error: $*" >&2; exit 1; }
log() { echo "netns.sh: $*" >&2; }

usage() {
    cat >&2 <<EOF
usage: $0 up HOSTS RATE   (e.g. up 2 1gbit, up 4 100mbit)
       $0 down
       $0 status
EOF
    exit 2
}

preflight() {
    [[ "$(id -u)" == 0 ]] || die "must run as root (network namespaces, veths and tc need CAP_NET_ADMIN)"
    command -v ip >/dev/null 2>&1 || die "'ip' not found; install iproute2 (apt-get install -y iproute2)"
    command -v tc >/dev/null 2>&1 || die "'tc' not found; install iproute2 (apt-get install -y iproute2)"
}

# all fr-* namespaces currently present
fr_namespaces() {
    ip netns list 2>/dev/null | awk '{print $1}' | grep "^${PREFIX}" | sort || true
}

cmd_down() {
    preflight
    local nss ns pids
    nss="$(fr_namespaces)"
    if [[ -n "$nss" ]]; then
        # 1) polite SIGTERM to every process inside any fr-* namespace
        for ns in $nss; do
            pids="$(ip netns pids "$ns" 2>/dev/null || true)"
            [[ -n "$pids" ]] && kill -TERM $pids 2>/dev/null || true
        done
        # 2) wait up to ~5 s for them to go, then SIGKILL the rest
        for _ in $(seq 50); do
            local left=""
            for ns in $nss; do
                left+="$(ip netns pids "$ns" 2>/dev/null || true)"
            done
            [[ -z "$left" ]] && break
            sleep 0.1
        done
        for ns in $nss; do
            pids="$(ip netns pids "$ns" 2>/dev/null || true)"
            if [[ -n "$pids" ]]; then
                log "SIGKILL to leftover processes in $ns: $(echo $pids)"
                kill -KILL $pids 2>/dev/null || true
            fi
        done
        # 3) delete namespaces (removes their veths and qdiscs with them)
        for ns in $nss; do
            ip netns del "$ns" 2>/dev/null || log "could not delete namespace $ns"
        done
    fi
    # 4) stray fr-* links in the root namespace (only possible if `up` died midway)
    local dev
    for dev in $(ip -o link show 2>/dev/null | awk -F': ' '{print $2}' | cut -d@ -f1 | grep "^${PREFIX}" || true); do
        ip link del "$dev" 2>/dev/null || true
    done
    [[ -z "$(fr_namespaces)" ]] || die "some fr-* namespaces remain: $(fr_namespaces | tr '\n' ' ')"
    log "down: no fr-* namespaces left"
}

cmd_up() {
    [[ $# -eq 2 ]] || usage
    local hosts="$1" rate="$2"
    [[ "$hosts" =~ ^[0-9]+$ ]] && (( hosts >= 1 && hosts <= 200 )) || die "HOSTS must be an integer in 1..200, got '$hosts'"
    [[ "$rate" =~ ^[0-9]+(\.[0-9]+)?([kmgt]?(bit|bps))$ ]] || die "RATE must look like 1gbit / 100mbit / 500kbit, got '$rate'"
    preflight
    [[ -z "$(fr_namespaces)" ]] || die "fr-* namespaces already exist ($(fr_namespaces | tr '\n' ' ')); run '$0 down' first"

    # if anything below fails, undo what was built
    trap 'log "up failed; tearing down"; cmd_down || true' ERR

    ip netns add "$SW"
    ip -n "$SW" link set lo up
    ip -n "$SW" link add "$BR" type bridge stp_state 0 forward_delay 0
    ip -n "$SW" link set "$BR" up

    local i ns hdev sdev addr
    for (( i = 0; i < hosts; i++ )); do
        ns="${PREFIX}h${i}"
        hdev="${PREFIX}eth${i}"
        sdev="${PREFIX}sp${i}"
        addr="${SUBNET}.$((BASE + i))/24"
        ip netns add "$ns"
        ip -n "$ns" link set lo up
        # create the pair directly inside the two namespaces (never in the root ns)
        ip -n "$ns" link add "$hdev" type veth peer name "$sdev" netns "$SW"
        ip -n "$ns" addr add "$addr" dev "$hdev"
        ip -n "$ns" link set "$hdev" up
        ip -n "$SW" link set "$sdev" master "$BR"
        ip -n "$SW" link set "$sdev" up
        # shape both directions of the host's link
        tc -n "$ns" qdisc add dev "$hdev" root tbf rate "$rate" burst "$TBF_BURST" latency "$TBF_LATENCY"
        tc -n "$SW" qdisc add dev "$sdev" root tbf rate "$rate" burst "$TBF_BURST" latency "$TBF_LATENCY"
    done
    trap - ERR
    log "up: $hosts hosts on ${SUBNET}.0/24 (host i = ${SUBNET}.$BASE+i), links shaped to $rate (tbf burst $TBF_BURST latency $TBF_LATENCY)"
}

cmd_status() {
    preflight
    local nss ns
    nss="$(fr_namespaces)"
    if [[ -z "$nss" ]]; then
        echo "no fr-* namespaces"
        return 0
    fi
    for ns in $nss; do
        echo "== $ns (pids: $(ip netns pids "$ns" 2>/dev/null | tr '\n' ' '))"
        ip -n "$ns" -br addr show | sed 's/^/   /'
        tc -n "$ns" qdisc show | grep -v 'noqueue' | sed 's/^/   /' || true
    done
}

[[ $# -ge 1 ]] || usage
sub="$1"; shift
case "$sub" in
    up) cmd_up "$@" ;;
    down) [[ $# -eq 0 ]] || usage; cmd_down ;;
    status) [[ $# -eq 0 ]] || usage; cmd_status ;;
    -h|--help|help) usage ;;
    *) usage ;;
esac
