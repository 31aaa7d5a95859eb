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
# - comfy-kitchen (ComfyUI's kernel library; ltx_mgpu uses its eager dequantization of
#   ComfyUI's quantized files) as its pure-Python wheel: pip would pick the 68 MB platform
#   wheel, whose CUDA/HIP extensions ltx_mgpu never calls (override: LTX_MGPU_COMFY_KITCHEN).
# - the official ComfyUI workflow templates the template tests run (requirements-templates.txt:
#   JSON only) into .templates/ with --no-deps --target, never into an environment (ComfyUI's own
#   environment keeps the templates package its requirements pin).
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$here"
venv="${LTX_MGPU_VENV:-$here/.venv}"
stamp="$venv/.ltx_mgpu_bootstrap"
templates="$here/.templates/comfyui-workflow-templates-json"
want="$(cat requirements.txt requirements-dev.txt requirements-templates.txt scripts/bootstrap.sh | sha256sum | cut -d' ' -f1)"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && [ -d "$templates" ]; then
  exit 0
fi
python3 -m venv "$venv"
py="$venv/bin/python"
"$py" -m pip install -q --upgrade pip
# shellcheck disable=SC2086 # word splitting wanted: LTX_MGPU_TORCH may carry pip options
"$py" -m pip install ${LTX_MGPU_TORCH:-torch==2.13.0}
grep -v -e '^ltx-core' -e '^comfy-kitchen' requirements.txt > "$venv/requirements-no-ltx.txt"
"$py" -m pip install -q -r "$venv/requirements-no-ltx.txt" -r requirements-dev.txt
"$py" -m pip install -q --no-deps "$(grep '^ltx-core' requirements.txt)"
wheels="$(mktemp -d)"
"$py" -m pip download -q --no-deps --only-binary=:all: --platform any \
  --python-version "$("$py" -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')" \
  -d "$wheels" "${LTX_MGPU_COMFY_KITCHEN:-comfy-kitchen==0.2.40}"
"$py" -m pip install -q --no-deps "$wheels"/comfy_kitchen-*.whl
rm -rf "$wheels"
rm -rf "$templates"
"$py" -m pip install -q --no-deps --target "$templates" -r requirements-templates.txt
if "$py" -c "import torchaudio" >/dev/null 2>&1; then
  echo "note: torchaudio is importable in $venv" >&2
fi
echo "$want" > "$stamp"
echo "ltx_mgpu: environment ready in $venv" >&2
