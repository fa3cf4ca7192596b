#!/usr/bin/env bash
# The README's install on a TPU VM, command for command, into a new virtualenv, then check.sh (platform tpu).
#
#   bash tests/installed/tpu_vm.sh                  a TPU VM that reaches the package indexes
#   bash tests/installed/tpu_vm.sh --offline SITE   a TPU machine that reaches none (the project's: its JAX and
#        libtpu installed, torch and the Hugging Face libraries unpacked in SITE by shared/tpu's on-device.sh):
#        the virtualenv sees the machine's packages, and SITE in place of the index; the wheel of this checkout,
#        built without build isolation, is installed with --no-deps --no-index
set -euo pipefail
root="$(cd "$(dirname "$0")/../.." && pwd)"
work="$(mktemp -d "${TMPDIR:-/tmp}/hf-tpu-vm.XXXXXX")"
trap 'rm -rf "$work"' EXIT
site="${2:-}"
if [ "${1:-}" = "--offline" ] && [ ! -d "$site" ]; then
    echo "usage: $0 [--offline SITE]: SITE must be a folder of unpacked packages" >&2
    exit 2
fi
unset PYTHONPATH
cd "$root"

if [ -z "$site" ]; then
    python3 -m venv "$work/venv"
    source "$work/venv/bin/activate"
    pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu
    pip install ".[hf]"
    pip install "jax[tpu]==0.10.2"
else
    python3 -m venv --system-site-packages "$work/venv"
    source "$work/venv/bin/activate"
    echo "$site" > "$(python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/offline-site.pth"
    PYTHONPATH="$site" pip wheel --no-deps --no-build-isolation --no-index -w "$work/dist" .  # SITE's setuptools
    pip install --no-deps --no-index "$work"/dist/hf_tpu-*.whl
fi

bash "$root/tests/installed/check.sh" "$work/venv" tpu
