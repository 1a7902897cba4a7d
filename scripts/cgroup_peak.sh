#!/usr/bin/env bash
# Run a command and every process it starts (Ray's raylet, workers and object store included)
# in a fresh cgroup v1 memory group, and print the group's peak usage (its page cache too).
#
#   sudo scripts/cgroup_peak.sh LABEL COMMAND [ARG ...]
#
# Prints "LABEL peak_mb=N rc=RC". Needs a writable cgroup v1 memory controller.
set -uo pipefail
label=${1:?usage: cgroup_peak.sh LABEL COMMAND [ARG ...]}
shift
group=/sys/fs/cgroup/memory/peak-$label-$$
mkdir "$group"
echo $$ > "$group/cgroup.procs"
"$@"
rc=$?
echo $$ > /sys/fs/cgroup/memory/cgroup.procs
peak=$(( $(cat "$group/memory.max_usage_in_bytes") / 1048576 ))
command -v ray > /dev/null && ray stop --force > /dev/null 2>&1  # a local Ray left running
sleep 2
rmdir "$group" 2> /dev/null || true
echo "$label peak_mb=$peak rc=$rc"
