# Sourced by scripts/*.sh: make (or reuse) a virtual environment with
# jaxfuse and its test/example dependencies installed.
#   make_venv DIR PYTHON [EXTRA_PIP_ARGS...]
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"

make_venv() {
  local dir="$1" python="$2"; shift 2
  local stamp="$dir/.jaxfuse-stamp"
  local want
  want="$(cat "$ROOT/pyproject.toml" | sha256sum | cut -c1-16) $*"
  if [[ ! -f "$stamp" || "$(cat "$stamp")" != "$want" ]]; then
    echo "== setting up $dir with $("$python" --version 2>&1)" >&2
    rm -rf "$dir"
    "$python" -m venv "$dir"
    "$dir/bin/python" -m pip install -q --upgrade pip >&2
    # The dependencies first (two environments may install at once), then
    # jaxfuse itself, editable, one environment at a time: that step
    # writes jaxfuse.egg-info into the tree.
    local deps
    mapfile -t deps < <("$dir/bin/python" - "$ROOT/pyproject.toml" <<'PY'
import sys, tomllib
project = tomllib.load(open(sys.argv[1], "rb"))["project"]
extras = project["optional-dependencies"]
print("\n".join(dict.fromkeys(
    project["dependencies"] + extras["test"] + extras["examples"])))
PY
)
    "$dir/bin/python" -m pip install -q "${deps[@]}" "$@" >&2
    flock "$ROOT/.venv.lock" \
      "$dir/bin/python" -m pip install -q --no-deps -e "$ROOT" >&2
    echo "$want" > "$stamp"
  fi
}

find_python312() {
  local p
  for p in "$HOME"/.pyenv/versions/3.12*/bin/python3.12 python3.12; do
    if "$p" -c 'import sys; assert sys.version_info[:2] == (3, 12)' \
        >/dev/null 2>&1; then
      command -v "$p"; return 0
    fi
  done
  return 1
}
