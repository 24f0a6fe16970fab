#!/usr/bin/env bash
# Run a command with its memory capped (a machine with less RAM than the model, emulated with a
# memory cgroup: anonymous memory and page cache both count; nothing swaps). Needs root and a
# writable cgroup v1 memory controller or cgroup v2 with the memory controller enabled.
#   scripts/run_capped.sh LIMIT_MIB COMMAND [ARGS...]
#   scripts/run_capped.sh 1200 .venv/bin/python -m specter.run recipes/disk-tier.yaml
# Exit status: the command's (137 when the kernel killed it for exceeding the cap); 2 for a bad
# LIMIT_MIB or no usable memory cgroup (nothing is run then). The cgroup is removed on every exit.
set -euo pipefail
if [ $# -lt 2 ]; then
  echo "usage: $0 LIMIT_MIB COMMAND [ARGS...]" >&2
  exit 2
fi
limit_mib=$1
shift
case "$limit_mib" in
  ''|*[!0-9]*|0*) echo "$0: LIMIT_MIB must be a whole number of MiB above 0, got '$limit_mib'" >&2; exit 2 ;;
esac
name="specter-cap-$$"
group=""
trap '[ -z "$group" ] || rmdir "$group" 2>/dev/null || true' EXIT
if [ -d /sys/fs/cgroup/memory ]; then
  parent=/sys/fs/cgroup/memory
  peak_file=memory.max_usage_in_bytes
elif grep -qw memory /sys/fs/cgroup/cgroup.controllers 2>/dev/null; then
  parent=/sys/fs/cgroup
  peak_file=memory.peak
else
  echo "$0: no memory cgroup here (cgroup v1 memory controller or v2 with memory enabled)" >&2
  exit 2
fi
if ! mkdir "$parent/$name" 2>/dev/null; then
  echo "$0: cannot create a cgroup under $parent (needs root and a writable cgroup filesystem)" >&2
  exit 2
fi
group=$parent/$name
bytes=$((limit_mib * 1024 * 1024))
if [ "$parent" = /sys/fs/cgroup/memory ]; then
  echo "$bytes" > "$group/memory.limit_in_bytes"
  # memory + swap capped at the same bytes: nothing swaps (absent without swap accounting)
  [ ! -e "$group/memory.memsw.limit_in_bytes" ] || echo "$bytes" > "$group/memory.memsw.limit_in_bytes" || true
else
  echo "$bytes" > "$group/memory.max"
  echo 0 > "$group/memory.swap.max" 2>/dev/null || true
fi
set +e
bash -c 'echo $$ > "$1/cgroup.procs" || { echo "run_capped: cannot enter the cgroup $1" >&2; exit 125; }
shift; exec "$@"' capped "$group" "$@"
status=$?
set -e
if [ -r "$group/$peak_file" ]; then
  peak="$(( $(cat "$group/$peak_file") / 1024 / 1024 )) MiB"
else
  peak="unknown (no $peak_file)"
fi
echo "run_capped: limit ${limit_mib} MiB, peak ${peak}, exit ${status}" >&2
exit $status
