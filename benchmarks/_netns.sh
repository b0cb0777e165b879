# Two "hosts" on one Linux machine: two network namespaces joined by a veth pair whose both
# ends are shaped with a token-bucket filter (tc tbf) to a rate in Mbit/s, each end shaping
# what it sends. Sourced (not run) by benchmarks/slow_link_hooks.sh, slow_link_sync.sh and
# two_host_job.sh. The loopback device is never touched (other jobs on the machine rely on
# its speed). Needs root and iproute2.
#
#   source benchmarks/_netns.sh
#   netns_up NAME SUBNET RATE_MBIT || exit 1
#
# netns_up makes namespaces NS0=NAME0_PID, NS1=NAME1_PID with veth ends V0=NAMEaPID (address
# SUBNET.1/24, in NS0) and V1=NAMEbPID (SUBNET.2/24, in NS1), PID being the calling script's
# $$; sets NS0 NS1 V0 V1 ADDR0 ADDR1 and a trap that deletes both namespaces (and with them
# the veth pair) when the script exits. It returns 1, with the reason on stderr, when
# anything cannot be made.

netns_down() {
  ip netns del "$NS0" 2>/dev/null
  ip netns del "$NS1" 2>/dev/null
}

netns_up() {
  local name=$1 subnet=$2 mbit=$3 ns
  command -v tc >/dev/null && command -v ip >/dev/null || { echo "needs iproute2 (ip, tc)" >&2; return 1; }
  NS0=${name}0_$$ NS1=${name}1_$$ V0=${name}a$$ V1=${name}b$$
  ADDR0=$subnet.1 ADDR1=$subnet.2
  trap netns_down EXIT INT TERM
  ip netns add "$NS0" && ip netns add "$NS1" || { echo "cannot make network namespaces" >&2; return 1; }
  ip link add "$V0" type veth peer name "$V1" || return 1
  ip link set "$V0" netns "$NS0" && ip link set "$V1" netns "$NS1" || return 1
  ip -n "$NS0" addr add "$ADDR0/24" dev "$V0" && ip -n "$NS1" addr add "$ADDR1/24" dev "$V1" || return 1
  for ns in "$NS0" "$NS1"; do ip -n "$ns" link set lo up; done
  ip -n "$NS0" link set "$V0" up && ip -n "$NS1" link set "$V1" up || return 1
  # burst above the veth's 64 KiB segments
  tc -n "$NS0" qdisc add dev "$V0" root tbf rate "${mbit}mbit" burst 256kb latency 100ms || return 1
  tc -n "$NS1" qdisc add dev "$V1" root tbf rate "${mbit}mbit" burst 256kb latency 100ms || return 1
}
