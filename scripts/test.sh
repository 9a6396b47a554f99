#!/usr/bin/env bash
# The tests: on the default python3 (its newest compatible JAX), then on
# Python 3.12 with the newest JAX when that interpreter exists. Sets
# everything up on first use. Extra arguments go to pytest; QUICK=1 skips
# the Python 3.12 run.
source "$(dirname "${BASH_SOURCE[0]}")/_env.sh"
cd "$ROOT"
make_venv "$ROOT/.venv" "${PYTHON:-python3}"
echo "== tests on $(.venv/bin/python --version), jax $(.venv/bin/python -c 'import jax; print(jax.__version__)')"
.venv/bin/python -m pytest "$@"
if [[ "${QUICK:-0}" != 1 ]] && py312="$(find_python312)" && \
   [[ "$("${PYTHON:-python3}" -c 'import sys; print(sys.version_info[:2])')" != "(3, 12)" ]]; then
  make_venv "$ROOT/.venv312" "$py312" --upgrade jax jaxlib
  echo "== tests on $(.venv312/bin/python --version), jax $(.venv312/bin/python -c 'import jax; print(jax.__version__)')"
  .venv312/bin/python -m pytest "$@"
fi
