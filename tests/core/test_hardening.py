"""Defects a new user hit: environment settings, version checks, dtype errors, seeds, pinned memory,
index checks. Each test fails on the code before its fix."""

import os
import subprocess
import sys

import pytest
import torch

import hf_tpu

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run_python(code: str, **env):
    full = {**os.environ, "HF_TPU_PLATFORM": "cpu", "HF_TPU_CACHE_DIR": "", **env}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=full, cwd=ROOT,
                          timeout=300)


# --- 1. an unsupported torch fails at import with the supported versions named


def test_import_on_an_unsupported_torch_names_the_supported_versions():
    result = run_python("import torch; torch.__version__ = '2.14.1'; import hf_tpu")
    assert result.returncode != 0
    assert "ImportError: hf_tpu 0.1.0 supports torch 2.13.x, and torch 2.14.1 is installed" in result.stderr


def test_supported_torch_range_in_metadata_is_the_tested_one():
    with open(os.path.join(ROOT, "pyproject.toml")) as f:
        assert '"torch>=2.13,<2.14"' in f.read()
    assert (torch.__version__.split(".")[0], torch.__version__.split(".")[1]) == ("2", "13")
