#!/usr/bin/env bash
# Create (or refresh) the project's virtual environment in .venv for development,
# tests and the command-line engine on a machine without ComfyUI.
#
#   bash scripts/bootstrap.sh            # idempotent; fast when nothing changed
#
# - torch: 2.13.0 from your pip index (override: LTX_MGPU_TORCH="torch==X --index-url URL").
# - ltx-core 1.0.0 is installed with --no-deps: it declares torchaudio, whose newest
#   wheel does not load beside CPU torch 2.13 and breaks transformers once installed.
#   Its other requirements are listed in requirements.txt.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$here"
venv="${LTX_MGPU_VENV:-$here/.venv}"
stamp="$venv/.ltx_mgpu_bootstrap"
want="$(cat requirements.txt requirements-dev.txt scripts/bootstrap.sh | sha256sum | cut -d' ' -f1)"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi
python3 -m venv "$venv"
py="$venv/bin/python"
"$py" -m pip install -q --upgrade pip
# shellcheck disable=SC2086 # word splitting wanted: LTX_MGPU_TORCH may carry pip options
"$py" -m pip install ${LTX_MGPU_TORCH:-torch==2.13.0}
grep -v '^ltx-core' requirements.txt > "$venv/requirements-no-ltx.txt"
"$py" -m pip install -q -r "$venv/requirements-no-ltx.txt" -r requirements-dev.txt
"$py" -m pip install -q --no-deps "$(grep '^ltx-core' requirements.txt)"
if "$py" -c "import torchaudio" >/dev/null 2>&1; then
  echo "note: torchaudio is importable in $venv" >&2
fi
echo "$want" > "$stamp"
echo "ltx_mgpu: environment ready in $venv" >&2
