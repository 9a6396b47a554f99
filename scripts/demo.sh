#!/usr/bin/env bash
# The demo: train the example language model with jaxfuse on 8 simulated CPU
# devices (sets everything up on first use). Extra arguments go to
# examples/train_lm.py, e.g.  bash scripts/demo.sh --sync dense
source "$(dirname "${BASH_SOURCE[0]}")/_env.sh"
make_venv "$ROOT/.venv" "${PYTHON:-python3}"
cd "$ROOT"
exec "$ROOT/.venv/bin/python" examples/train_lm.py "$@"
