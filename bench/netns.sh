#!/usr/bin/env bash
# bench/netns.sh: "machines" on one host for bench/advice.sh, as network
# namespaces fitlm-m0 .. fitlm-m(N-1) joined by a bridge (flbr0) in the
# launching namespace, each by a veth pair whose two ends are rate-limited
# with tbf (what leaves and what enters a machine: a full-duplex link of RATE
# each way). Ranks in one namespace talk over TCP through the kernel's local
# path (fast, no limit: the "inside a machine" links); ranks in two talk
# across the limited links (the "between machines" network). Root only.
#
#   bench/netns.sh up [RATE] [N]   # creates them (default 1gbit, 2 machines);
#                                  # replaces an earlier set (idempotent)
#   bench/netns.sh down            # removes them (idempotent; nothing there: no-op)
#   bench/netns.sh bw [MB]         # measures a TCP transfer of MB (default 64)
#                                  # from m0 to m1 and inside m0; prints MB/s
#   bench/netns.sh rank CMD...     # under mpirun: runs CMD in machine
#                                  # OMPI_COMM_WORLD_RANK / PER_MACHINE
#                                  # (env, default 2), through netns_exec.py
#   bench/netns.sh show            # the namespaces, addresses and qdiscs
#
# Machine i has address 10.77.0.(i+1)/24 on its interface fln<i>; MPI's TCP
# BTL is pointed at 10.77.0.0/24 (bench/advice.sh: --mca btl tcp,self
# --mca btl_tcp_if_include 10.77.0.0/24). No delay: this kernel has no
# sch_netem ("Specified qdisc kind is unknown"), and none of the qdiscs it
# has (tbf, htb, pfifo) delays packets, so the link is slowed by its rate
# only; tbf's queue (latency 50ms) adds delay only when the link is full.
set -euo pipefail
NET=10.77.0
BR=flbr0
PREFIX=fitlm-m

down() {
    local ns
    for ns in $(ip netns list | awk -v p="$PREFIX" 'index($1, p) == 1 { print $1 }'); do
        ip netns del "$ns"
    done
    # the host ends of the veth pairs go with their peers a moment later, or
    # stay while a process (a rank killed half-way) still holds the namespace:
    # then they are deleted here, which takes the peer along
    local t h
    for ((t = 0; t < 30; t++)); do
        ip -o link show | grep -q ' flh[0-9]*@' || break
        sleep 0.1
    done
    for h in $(ip -o link show | sed -n 's/^[0-9]*: \(flh[0-9]*\)@.*/\1/p'); do
        ip link del "$h" 2>/dev/null || true
    done
    if ip link show "$BR" >/dev/null 2>&1; then ip link del "$BR"; fi
    return 0
}

# tbf BURST in bytes: 2 ms of RATE, at least 128 KiB (veth hands tbf GSO
# packets of up to 64 KiB; a burst below one packet drops it)
burst() {
    awk -v r="$1" 'BEGIN { n = r + 0; u = tolower(r); sub(/^[0-9.]+/, "", u)
        m = u ~ /^g/ ? 1e9 : u ~ /^m/ ? 1e6 : u ~ /^k/ ? 1e3 : 1
        if (u ~ /bps$/) m *= 8
        b = n * m / 8 * 0.002; if (b < 131072) b = 131072; printf "%d", b }'
}

up() {
    local rate=${1:-1gbit} n=${2:-2} i b
    [[ $(id -u) == 0 ]] || { echo "netns.sh: needs root (ip netns, tc)" >&2; exit 1; }
    down
    b=$(burst "$rate")
    ip link add "$BR" type bridge
    ip link set "$BR" up
    for ((i = 0; i < n; i++)); do
        ip netns add "$PREFIX$i"
        ip link add "flh$i" type veth peer name "fln$i" netns "$PREFIX$i"
        ip link set "flh$i" master "$BR" up
        ip -n "$PREFIX$i" addr add "$NET.$((i + 1))/24" dev "fln$i"
        ip -n "$PREFIX$i" link set "fln$i" up
        ip -n "$PREFIX$i" link set lo up
        tc -n "$PREFIX$i" qdisc add dev "fln$i" root tbf rate "$rate" burst "$b" latency 50ms
        tc qdisc add dev "flh$i" root tbf rate "$rate" burst "$b" latency 50ms
    done
    echo "netns.sh: $n machines ${PREFIX}0..$((n - 1)) on $NET.0/24, links $rate each way (tbf burst $b bytes), no delay"
}

# bw MB: MB/s of one TCP stream m0 -> m1 (across the link) and m0 -> m0
# (inside a machine), python3 at both ends
bw() {
    local mb=${1:-64} to
    for to in "1 $NET.2" "0 $NET.1"; do
        set -- $to
        ip netns exec "${PREFIX}$1" python3 -c '
import socket, sys
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((sys.argv[1], 5999)); s.listen(1); c, _ = s.accept()
while c.recv(1 << 20): pass' "$2" &
        local srv=$!
        sleep 0.5
        ip netns exec "${PREFIX}0" python3 -c '
import socket, sys, time
n = int(sys.argv[2]) << 20; buf = bytes(1 << 20)
c = socket.create_connection((sys.argv[1], 5999)); t = time.time()
for _ in range(n >> 20): c.sendall(buf)
c.shutdown(socket.SHUT_WR); c.recv(1); dt = time.time() - t
print("%s: %d MiB in %.2f s: %.1f MB/s (%.2f Gbit/s)" % (sys.argv[3], n >> 20, dt, n / dt / 1e6, n * 8 / dt / 1e9))' \
            "$2" "$mb" "$([[ $1 == 1 ]] && echo "m0 -> m1 (across the link)" || echo "m0 -> m0 (inside a machine)")"
        wait "$srv"
    done
}

case ${1:-} in
up) up "${2:-}" "${3:-}" ;;
down) down ;;
bw) bw "${2:-}" ;;
rank)
    shift
    exec "$(dirname "$0")/netns_exec.py" "$PREFIX$((${OMPI_COMM_WORLD_RANK:?run under mpirun} / ${PER_MACHINE:-2}))" "$@"
    ;;
show)
    ip netns list | grep "^$PREFIX" || true
    for ns in $(ip netns list | awk -v p="$PREFIX" 'index($1, p) == 1 { print $1 }'); do
        echo "$ns: $(ip -n "$ns" -4 -o addr show | awk '$2 != "lo" { print $2, $4 }'); $(tc -n "$ns" qdisc show | grep tbf)"
    done
    ;;
*)
    sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'
    exit 2
    ;;
esac
