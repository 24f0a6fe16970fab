#!/usr/bin/env bash
# Run a command with its memory capped (a machine with less RAM than the model, emulated with a
# memory cgroup: anonymous memory and page cache both count; nothing swaps). Needs root and a
# writable cgroup v1 memory controller or cgroup v2 with the memory controller enabled.
#   scripts/run_capped.sh LIMIT_MIB COMMAND [ARGS...]
#   scripts/run_capped.sh 1200 .venv/bin/python -m specter.run recipes/disk-tier.yaml
# Exit status: the command's (137 when the kernel killed it for exceeding the cap).
set -euo pipefail
if [ $# -lt 2 ]; then
  echo "usage: $0 LIMIT_MIB COMMAND [ARGS...]" >&2
  exit 2
fi
limit_mib=$1
shift
name="specter-cap-$$"
if [ -d /sys/fs/cgroup/memory ]; then
  group=/sys/fs/cgroup/memory/$name
  mkdir "$group"
  echo $((limit_mib * 1024 * 1024)) > "$group/memory.limit_in_bytes"
  peak_file=memory.max_usage_in_bytes
elif grep -qw memory /sys/fs/cgroup/cgroup.controllers 2>/dev/null; then
  group=/sys/fs/cgroup/$name
  mkdir "$group"
  echo $((limit_mib * 1024 * 1024)) > "$group/memory.max"
  echo 0 > "$group/memory.swap.max" 2>/dev/null || true
  peak_file=memory.peak
else
  echo "$0: no writable memory cgroup here" >&2
  exit 2
fi
set +e
bash -c 'echo $$ > "$1/cgroup.procs"; shift; exec "$@"' capped "$group" "$@"
status=$?
set -e
peak=$(cat "$group/$peak_file" 2>/dev/null || echo 0)
echo "run_capped: limit ${limit_mib} MiB, peak $((peak / 1024 / 1024)) MiB, exit ${status}" >&2
rmdir "$group" 2>/dev/null || true
exit $status
