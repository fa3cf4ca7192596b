#!/usr/bin/env bash
# The first things a user runs after installing, from a folder outside the checkout: `import hf_tpu` (which
# must come from the virtualenv's site-packages), an op on tpu, `hf-tpu env`, `hf-tpu demo`.
#
# Usage: tests/installed/check.sh VENV [PLATFORM]   (PLATFORM: the one `tpu` must run on, e.g. tpu on a TPU VM)
set -euo pipefail
unset PYTHONPATH  # hf_tpu must come from the virtualenv, and nothing else may put it on the path
venv="$(cd "$1" && pwd)"
expected_platform="${2:-}"
outside="$(mktemp -d "${TMPDIR:-/tmp}/hf-tpu-outside.XXXXXX")"
trap 'rm -rf "$outside"' EXIT
cd "$outside"

echo "== import hf_tpu and run an op on tpu"
HF_TPU_EXPECTED_PLATFORM="$expected_platform" "$venv/bin/python" - <<'PY'
import os
import sysconfig

import torch

import hf_tpu

site_packages = sysconfig.get_paths()["platlib"]
assert os.path.dirname(os.path.dirname(hf_tpu.__file__)) == site_packages, (hf_tpu.__file__, site_packages)
expected = os.environ["HF_TPU_EXPECTED_PLATFORM"]
assert expected in ("", hf_tpu.platform_name()), (hf_tpu.platform_name(), expected)
x = torch.arange(6.0, device="tpu").reshape(2, 3)
y = (x * 2).sum(0)
assert y.device.type == "tpu" and torch.equal(y.cpu(), torch.tensor([6.0, 10.0, 14.0])), y
print(f"hf_tpu {hf_tpu.__version__} from {os.path.dirname(hf_tpu.__file__)}: {y.cpu().tolist()} on {y.device}, "
      f"platform {hf_tpu.platform_name()}")
PY

echo "== hf-tpu env"
"$venv/bin/hf-tpu" env
echo "== hf-tpu demo"
"$venv/bin/hf-tpu" demo
