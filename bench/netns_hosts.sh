#!/bin/sh
# netns_hosts.sh up|down [N]: N network namespaces dcb0..dcb<N-1> (default
# 2), each a "host" with an address 10.99.0.<i+2> on a bridge dcbr
# (10.99.0.1) in this namespace, for elastic_bench --netns (root; Debian's
# iproute2):
#
#   bench/netns_hosts.sh up
#   elastic_bench --world 8 --netns dcb0=10.99.0.2,dcb1=10.99.0.3 --master-addr 10.99.0.1
#   bench/netns_hosts.sh down
set -eu
n=${2:-2}
case "${1:-}" in
  up)
    ip link add dcbr type bridge
    ip addr add 10.99.0.1/24 dev dcbr
    ip link set dcbr up
    i=0
    while [ "$i" -lt "$n" ]; do
      ip netns add "dcb$i"
      ip link add "vdcb$i" type veth peer name eth0 netns "dcb$i"
      ip link set "vdcb$i" master dcbr up
      ip -n "dcb$i" addr add "10.99.0.$((i + 2))/24" dev eth0
      ip -n "dcb$i" link set eth0 up
      ip -n "dcb$i" link set lo up
      i=$((i + 1))
    done ;;
  down)
    i=0
    while [ "$i" -lt "$n" ]; do
      ip netns del "dcb$i" 2>/dev/null || true
      i=$((i + 1))
    done
    ip link del dcbr 2>/dev/null || true ;;
  *) echo "usage: $0 up|down [N]" >&2; exit 2 ;;
esac
