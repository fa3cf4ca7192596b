#!/usr/bin/env bash
# The package as a user gets it, checked from outside the checkout; the README's test command runs this after
# the suite, which runs against the editable checkout and so cannot see a package left out of the wheel or a
# file left out of the sdist. It builds the sdist, a wheel from the unpacked sdist (as pip does with an sdist),
# installs that wheel with its `hf` extra into a new virtualenv (the versions pinned by requirements-dev.txt),
# runs check.sh there (import, an op on tpu, `hf-tpu env`, `hf-tpu demo`), and then tests/core and the
# Transformers adapter's loading and attention tests against the installed package, from a folder that holds a
# copy of tests/, pyproject.toml (pytest's settings) and README.md (which a test compares with the settings),
# and no package.
#
# Usage, after the README's install: bash tests/installed/wheel.sh [more pytest arguments]
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
root="$(cd "$here/../.." && pwd)"
build_python="$root/.venv/bin/python"
work="$(mktemp -d "${TMPDIR:-/tmp}/hf-tpu-wheel.XXXXXX")"
trap 'rm -rf "$work"' EXIT
unset PYTHONPATH

quietly() {  # a step whose output shows only where it fails
    "$@" > "$work/step.log" 2>&1 || { cat "$work/step.log"; return 1; }
}

echo "== the sdist, and a wheel built from it"
# from a copy of the files git knows (tracked, or new and not ignored), as a fresh clone has them: setuptools
# would otherwise also ship what an earlier build listed in the checkout's ignored hf_tpu.egg-info/SOURCES.txt
mkdir "$work/clone"
(cd "$root" && git ls-files -z --cached --others --exclude-standard | tar --null --ignore-failed-read -T - -cf -) | tar -C "$work/clone" -xf -
(cd "$work/clone" && quietly "$build_python" -c 'import sys, setuptools.build_meta as b; b.build_sdist(sys.argv[1])' "$work/dist")
tar -xzf "$work"/dist/hf_tpu-*.tar.gz -C "$work"
quietly "$build_python" -m pip wheel --no-deps --no-build-isolation -w "$work/dist" "$work"/hf_tpu-*/
wheel="$(ls "$work"/dist/hf_tpu-*.whl)"
basename "$wheel"

echo "== a new virtualenv with the wheel and its hf extra"
python3 -m venv "$work/venv"
grep -v '^-e' "$root/requirements-dev.txt" > "$work/constraints.txt"  # the pins, less the editable checkout
quietly "$work/venv/bin/pip" install -c "$work/constraints.txt" "$wheel[hf]" pytest pytest-xdist expecttest

bash "$here/check.sh" "$work/venv"

echo "== tests/core and the Transformers adapter's tests, against the installed package"
mkdir "$work/outside"
tar -C "$root" --exclude=__pycache__ -cf - tests pyproject.toml README.md | tar -C "$work/outside" -xf -
cd "$work/outside"
# pytest puts this folder (the tests' root) on sys.path, and it holds no hf_tpu: the tests import the installed one
"$work/venv/bin/python" -m pytest -p no:cacheprovider -q -n 2 tests/core tests/test_adapter_loading.py \
    tests/test_transformers_loading.py tests/test_transformers_attention.py "$@"
