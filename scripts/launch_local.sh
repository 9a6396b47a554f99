#!/usr/bin/env bash
# Try multi-host training on one machine: N processes of the example LM
# under jax.distributed on localhost, each with 8/N simulated CPU devices
# (the same 8 workers as the one-process demo; gloo carries the collectives).
#   bash scripts/launch_local.sh N [train_lm.py arguments...]
# e.g.  bash scripts/launch_local.sh 2 --steps 200
# Process 0 prints; every process's log is in $LOGDIR (default a temp dir).
source "$(dirname "${BASH_SOURCE[0]}")/_env.sh"
n="${1:?usage: launch_local.sh N [train_lm.py arguments...]}"; shift
if ! [[ "$n" =~ ^[1-8]$ ]] || (( 8 % n )); then
  echo "launch_local.sh: N=$n must divide 8 (1, 2, 4 or 8 processes)" >&2
  exit 2
fi
make_venv "$ROOT/.venv" "${PYTHON:-python3}"
cd "$ROOT"
port="$("$ROOT/.venv/bin/python" -c 'import socket; s = socket.socket(); s.bind(("", 0)); print(s.getsockname()[1])')"
logdir="${LOGDIR:-$(mktemp -d)}"
pids=()
for ((i = 0; i < n; i++)); do
  JAX_PLATFORMS=cpu PYTHONPATH="$ROOT" "$ROOT/.venv/bin/python" \
    examples/train_lm.py --cpu-devices $((8 / n)) \
    --coordinator "localhost:$port" --num-processes "$n" --process-id "$i" \
    "$@" > "$logdir/process_$i.log" 2>&1 &
  pids+=($!)
done
trap 'kill "${pids[@]}" 2>/dev/null' INT TERM
tail -n +1 -f "$logdir/process_0.log" --pid "${pids[0]}" &
status=0
for pid in "${pids[@]}"; do wait "$pid" || status=$?; done
wait
if (( status )); then
  echo "launch_local.sh: a process failed; logs in $logdir" >&2
fi
exit "$status"
