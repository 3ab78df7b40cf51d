#!/usr/bin/env bash
# The first thing to run when a machine with an NVIDIA GPU is lent: one command, ending by its
# --deadline-s (default 480 s), everything under --out, a summary printed last
# (benchmarks/log/gpu.md, "Running on a GPU", says what to bring and the command line).
#
#   bash scripts/gpu_check.sh --out DIR [--wheels WHEELS] [--dry-run] [gpu_check.py options]
#
# --wheels WHEELS: install the wheels `scripts/gpu_wheels.sh` downloaded (what the GPU image
#   lacks: pydantic, grain, ...) with --no-deps into DIR/site, before anything imports, and put
#   it first on PYTHONPATH; the project itself is installed there too when the Python at hand
#   cannot import it (no network needed: --no-build-isolation uses the image's setuptools).
# --dry-run: the same steps on the CPU, small (8 virtual devices): how the script is tested.
# The steps and DIR/gpu_check.json: scripts/gpu_check.py. Python: $PYTHON, else python3.
set -euo pipefail
cd "$(dirname "$0")/.."
out="" wheels="" pass=()
while [[ $# -gt 0 ]]; do
  case "$1" in
    --out) out=$2; shift 2 ;;
    --wheels) wheels=$2; shift 2 ;;
    *) pass+=("$1"); shift ;;
  esac
done
if [[ -z "$out" ]]; then
  echo "error: --out: missing; give the folder the check writes into (--out DIR)" >&2
  exit 2
fi
py=${PYTHON:-python3}
mkdir -p "$out"
site="$(cd "$out" && pwd)/site"
if [[ -n "$wheels" ]]; then
  if ! compgen -G "$wheels/*.whl" >/dev/null; then
    echo "error: --wheels $wheels: no .whl files there; fill it with: bash scripts/gpu_wheels.sh $wheels" >&2
    exit 2
  fi
  "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" "$wheels"/*.whl
  export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
fi
if ! (cd / && "$py" -c "import maestro_jax.models" 2>/dev/null); then
  # models/ installs as maestro_jax.models (pyproject's package-dir): the source tree alone does not import
  "$py" -m pip install -q --no-index --no-deps --no-build-isolation --no-compile --upgrade --target "$site" .
  export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
fi
exec "$py" scripts/gpu_check.py --out "$out" "${pass[@]}"
