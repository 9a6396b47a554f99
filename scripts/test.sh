#!/usr/bin/env bash
# The tests: on the default python3 (its newest compatible JAX) and, at the
# same time, on Python 3.12 with the newest JAX when that interpreter exists
# (each run compiles mostly on one core, so the two share the machine well;
# the 3.12 run's output follows the first's). Sets everything up on first
# use. Extra arguments go to pytest; QUICK=1 skips the Python 3.12 run.
# The tests marked `example` (examples/train_lm.py and the jaxfuse CLI
# end to end in subprocesses) run once: on the first interpreter, except
# those also marked `second`, on 3.12, to balance the two runs (the CLI's
# profile-plan-show run); they drive the same library code the in-process
# tests cover on both.
source "$(dirname "${BASH_SOURCE[0]}")/_env.sh"
cd "$ROOT"
second=""
only_first=()
if [[ "${QUICK:-0}" != 1 ]] && py312="$(find_python312)" && \
   [[ "$("${PYTHON:-python3}" -c 'import sys; print(sys.version_info[:2])')" != "(3, 12)" ]]; then
  second="$(mktemp)"
  ( make_venv "$ROOT/.venv312" "$py312" --upgrade jax jaxlib
    echo "== tests on $(.venv312/bin/python --version), jax $(.venv312/bin/python -c 'import jax; print(jax.__version__)')"
    .venv312/bin/python -m pytest -p no:cacheprovider \
      -m "not example or second" "$@"
  ) > "$second" 2>&1 &
  pid=$!
  only_first=(-m "not (example and second)")
fi
make_venv "$ROOT/.venv" "${PYTHON:-python3}"   # while the 3.12 one is made
echo "== tests on $(.venv/bin/python --version), jax $(.venv/bin/python -c 'import jax; print(jax.__version__)')"
status=0
.venv/bin/python -m pytest -p no:cacheprovider "${only_first[@]}" "$@" || status=$?
if [[ -n "$second" ]]; then
  wait "$pid" || status=$?
  cat "$second"
  rm -f "$second"
fi
exit "$status"
