#!/usr/bin/env bash
# Try multi-host training on one machine: N processes of the example LM
# under jax.distributed on localhost, each with 8/N simulated CPU devices
# (the same 8 workers as the one-process demo; gloo carries the collectives).
#   bash scripts/launch_local.sh N [train_lm.py arguments...]
# e.g.  bash scripts/launch_local.sh 2 --steps 200 --checkpoint-dir ck
# Process 0 prints; every process's log is in $LOGDIR (default a temp dir).
#
# When one process dies, the others would only wait in their next
# collective until gloo gives up ("Is there a distributed collective
# mismatch in your code?"). So the launcher watches them: the first that
# exits with an error is named (rank, exit code or signal), the others are
# stopped, and the newest checkpoint under --checkpoint-dir, if any, is
# named with the command that resumes from it.
# Environment: LOGDIR; STOP_GRACE_S (default 5); TRAIN_SCRIPT (default examples/train_lm.py) and
# LAUNCH_PYTHON (an interpreter to use as is, instead of making .venv).
source "$(dirname "${BASH_SOURCE[0]}")/_env.sh"
n="${1:?usage: launch_local.sh N [train_lm.py arguments...]}"; shift
if ! [[ "$n" =~ ^[1-8]$ ]] || (( 8 % n )); then
  echo "launch_local.sh: N=$n must divide 8 (1, 2, 4 or 8 processes)" >&2
  exit 2
fi
if [[ -n "${LAUNCH_PYTHON:-}" ]]; then
  python="$LAUNCH_PYTHON"
else
  make_venv "$ROOT/.venv" "${PYTHON:-python3}"
  python="$ROOT/.venv/bin/python"
fi
script="${TRAIN_SCRIPT:-examples/train_lm.py}"
cd "$ROOT"

# the run's checkpoint directory, from its arguments (none: no resume hint)
ckdir=""
resume_flag=" --resume"
args=("$@")
for ((i = 0; i < ${#args[@]}; i++)); do
  case "${args[i]}" in
    --resume) resume_flag="" ;;
    --checkpoint-dir=*) ckdir="${args[i]#--checkpoint-dir=}" ;;
    --checkpoint-dir) ckdir="${args[i + 1]:-}" ;;
  esac
done

newest_checkpoint() {   # the largest step directory (a finished save)
  [[ -n "$ckdir" && -d "$ckdir" ]] || return 0
  local d best=""
  for d in "$ckdir"/*/; do
    d="$(basename "$d")"
    [[ "$d" =~ ^[0-9]+$ ]] || continue   # orbax's unfinished saves: tmp names
    if [[ -z "$best" ]] || (( 10#$d > 10#$best )); then best="$d"; fi
  done
  [[ -n "$best" ]] && echo "$ckdir/$best"
  return 0
}

describe() {   # an exit status as words
  local rc="$1"
  if (( rc > 128 )); then
    echo "was killed by signal $((rc - 128)) ($(kill -l "$((rc - 128))" 2>/dev/null || echo '?'))"
  else
    echo "exited with code $rc"
  fi
}

port="$("$python" -c 'import socket; s = socket.socket(); s.bind(("", 0)); print(s.getsockname()[1])')"
logdir="${LOGDIR:-$(mktemp -d)}"
mkdir -p "$logdir"
pids=()
declare -A rank_of=()
for ((i = 0; i < n; i++)); do
  JAX_PLATFORMS=cpu PYTHONPATH="$ROOT" "$python" \
    "$script" --cpu-devices $((8 / n)) \
    --coordinator "localhost:$port" --num-processes "$n" --process-id "$i" \
    "$@" > "$logdir/process_$i.log" 2>&1 &
  pids+=($!)
  rank_of[$!]=$i
done
stop_all() {   # TERM, then KILL after a grace period: jax.distributed
  # takes SIGTERM as a preemption notice, so a process in a collective stays
  local pid t
  kill "${pids[@]}" 2>/dev/null || true
  for ((t = 0; t < 10 * ${STOP_GRACE_S:-5}; t++)); do
    for pid in "${pids[@]}"; do
      if kill -0 "$pid" 2>/dev/null; then sleep 0.1; continue 2; fi
    done
    return 0
  done
  kill -KILL "${pids[@]}" 2>/dev/null || true
}
trap 'stop_all; exit 130' INT TERM
tail -n +1 -f "$logdir/process_0.log" --pid "${pids[0]}" &
tailer=$!

status=0
running=("${pids[@]}")
while (( ${#running[@]} )); do
  finished=""
  rc=0
  wait -n -p finished "${running[@]}" || rc=$?
  [[ -n "$finished" ]] || break   # no process left to wait for
  still=()
  for pid in "${running[@]}"; do
    [[ "$pid" == "$finished" ]] || still+=("$pid")
  done
  running=("${still[@]+"${still[@]}"}")
  if (( rc != 0 && status == 0 )); then
    status=$rc
    rank="${rank_of[$finished]}"
    {
      echo "launch_local.sh: process $rank (pid $finished) $(describe "$rc"); stopping the other $((n - 1)) (they would wait in their next collective until gloo gives up with a 'collective mismatch' error)."
      echo "launch_local.sh: process $rank's log: $logdir/process_$rank.log"
      resume="$(newest_checkpoint)"
      if [[ -n "$resume" ]]; then
        echo "launch_local.sh: newest checkpoint: $resume; resume with: bash scripts/launch_local.sh $n $*$resume_flag"
      elif [[ -n "$ckdir" ]]; then
        echo "launch_local.sh: no checkpoint under $ckdir yet; rerun from the start."
      else
        echo "launch_local.sh: no --checkpoint-dir given, so nothing to resume from."
      fi
    } >&2
    stop_all
  fi
done
kill "$tailer" 2>/dev/null || true
wait "$tailer" 2>/dev/null || true
if (( status )); then
  echo "launch_local.sh: a process failed; logs in $logdir" >&2
fi
exit "$status"
