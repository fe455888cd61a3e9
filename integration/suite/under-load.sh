#!/usr/bin/env bash
# Runs a command (by default the whole suite, `just test`) while busy loops
# hold some of the machine's cores, as a shared CI machine is busy: a test
# that only passes on an idle machine fails here. Samples the load average
# every 15 s and prints its range at the end. Every process it starts (the
# busy loops, the sampler) is stopped by its pid, on success, failure or
# Ctrl-C.
#
#   integration/suite/under-load.sh [command ...]
#   KVMESH_BUSY_LOOPS=N  how many busy loops (default 1: one core held)
set -uo pipefail
cd "$(dirname "$0")/../.."

loops=${KVMESH_BUSY_LOOPS:-1}
case $loops in
'' | *[!0-9]*)
    echo "kvmesh test-under-load: KVMESH_BUSY_LOOPS must be a whole number, not '$loops'" >&2
    exit 2
    ;;
esac
[ $# -gt 0 ] || set -- just test

mkdir -p target/test-logs
samples=target/test-logs/loadavg-$(date -u +%Y%m%dT%H%M%SZ).txt
pids=()
stop() {
    for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null; done
    for pid in "${pids[@]}"; do wait "$pid" 2>/dev/null; done
    pids=()
}
trap stop EXIT
trap 'stop; exit 130' INT TERM

for _ in $(seq 1 "$loops"); do
    # Its own session, so nothing the tests do to process groups reaches it.
    setsid bash -c 'while :; do :; done' &
    pids+=($!)
done
(
    while :; do
        printf '%s %s\n' "$(date -u +%H:%M:%S)" "$(cut -d' ' -f1-3 /proc/loadavg)" >>"$samples"
        sleep 15
    done
) &
pids+=($!)
echo "kvmesh test-under-load: $loops busy loop(s) (pids ${pids[*]:0:$loops}); load samples in $samples" >&2

start=$SECONDS
"$@"
status=$?
stop
trap - EXIT INT TERM

# The 1-minute load average over the run: lowest, median, highest.
read -r n low median high < <(awk '{print $2}' "$samples" | sort -n |
    awk '{v[NR] = $1} END {if (NR) print NR, v[1], v[int((NR + 1) / 2)], v[NR]; else print 0, "-", "-", "-"}')
echo "kvmesh test-under-load: '$*' exited $status after $((SECONDS - start)) s with $loops busy loop(s); 1-minute load average over $n samples: min $low, median $median, max $high" >&2
exit "$status"
