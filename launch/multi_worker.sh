#!/usr/bin/env bash
# Start N local worker processes of launch/train.py with TF_CONFIG on free
# localhost ports (--replicator=multi_worker), wait for them, and always stop
# them on exit, error or Ctrl-C.
#
#   launch/multi_worker.sh [--dry-run] N [train.py flags...]
#   launch/multi_worker.sh 2 --model=mlp --config=local --compression=dct
#
# Worker 0 (the chief) prints to this terminal; worker i > 0 logs to
# $LOG_DIR/worker_i.log (LOG_DIR defaults to a fresh temporary directory,
# printed at start; the logs of failed workers are shown at the end).
# --dry-run prints the TF_CONFIG and command of every worker and starts none.
# PYTHON (default: python3) is the interpreter.
set -u

usage() {
  sed -n '2,14p' "$0" | sed 's/^# \{0,1\}//'
}

dry_run=0
if [[ $# -ge 1 && ( "$1" == "-h" || "$1" == "--help" ) ]]; then usage; exit 0; fi
if [[ $# -ge 1 && "$1" == "--dry-run" ]]; then dry_run=1; shift; fi
if [[ $# -lt 1 ]]; then
  echo "multi_worker.sh: missing N (the number of workers)" >&2; usage >&2; exit 2
fi
n="$1"; shift
if ! [[ "$n" =~ ^[0-9]+$ ]] || (( n < 1 )); then
  echo "multi_worker.sh: N must be an integer >= 1, got '$n'" >&2; exit 2
fi
for arg in "$@"; do
  case "$arg" in
    --replicator=*|--replicator)
      echo "multi_worker.sh: do not pass --replicator; it is always multi_worker" >&2; exit 2;;
  esac
done

PYTHON="${PYTHON:-python3}"
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"

# N distinct free ports, held open together while they are picked.
ports="$("$PYTHON" - "$n" <<'PY'
import socket, sys
socks = []
for _ in range(int(sys.argv[1])):
  s = socket.socket(); s.bind(("localhost", 0)); socks.append(s)
print(" ".join(str(s.getsockname()[1]) for s in socks))
PY
)" || { echo "multi_worker.sh: could not pick free ports" >&2; exit 1; }
read -r -a port_list <<< "$ports"
workers=""
for p in "${port_list[@]}"; do workers+="${workers:+,}\"localhost:$p\""; done

tf_config() {
  printf '{"cluster":{"worker":[%s]},"task":{"type":"worker","index":%d}}' "$workers" "$1"
}

if (( dry_run )); then
  for ((i = 0; i < n; i++)); do
    printf "TF_CONFIG='%s' %s -m launch.train --replicator=multi_worker" "$(tf_config "$i")" "$PYTHON"
    printf " %q" "$@"; echo
  done
  exit 0
fi

LOG_DIR="${LOG_DIR:-$(mktemp -d -t multi_worker.XXXXXX)}"
mkdir -p "$LOG_DIR"
echo "multi_worker.sh: $n workers on ports ${port_list[*]}; logs in $LOG_DIR" >&2

pids=()
cleanup() {
  trap - EXIT INT TERM
  for pid in "${pids[@]}"; do
    kill "$pid" 2>/dev/null
  done
  sleep 1
  for pid in "${pids[@]}"; do
    kill -9 "$pid" 2>/dev/null
  done
  wait 2>/dev/null
}
trap cleanup EXIT
trap 'echo "multi_worker.sh: interrupted, stopping workers" >&2; exit 130' INT TERM

cd "$here" || exit 1
for ((i = 0; i < n; i++)); do
  if (( i == 0 )); then
    TF_CONFIG="$(tf_config "$i")" "$PYTHON" -m launch.train --replicator=multi_worker "$@" &
  else
    TF_CONFIG="$(tf_config "$i")" "$PYTHON" -m launch.train --replicator=multi_worker "$@" \
      > "$LOG_DIR/worker_$i.log" 2>&1 &
  fi
  pids+=("$!")
done

status=0
for ((i = 0; i < n; i++)); do
  wait "${pids[$i]}"; rc=$?
  if (( rc != 0 )); then
    echo "multi_worker.sh: worker $i exited with status $rc" >&2
    if (( i > 0 )); then tail -n 20 "$LOG_DIR/worker_$i.log" >&2; fi
    status=$rc
    break  # the others would wait for it forever: the trap stops them
  fi
done
exit "$status"
