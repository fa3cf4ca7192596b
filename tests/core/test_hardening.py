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


# --- 2. HF_TPU_* variables parsed the way users write them, one module for all


@pytest.mark.parametrize("text", ["false", "FALSE", "no", "off", "0", " Off "])
def test_cpu_fallback_off_spelled_any_way(monkeypatch, text):
    from hf_tpu import dispatch

    monkeypatch.setenv("HF_TPU_CPU_FALLBACK", text)
    sig = dispatch.signature(torch.ops.aten._fft_r2c.default)
    with pytest.raises(NotImplementedError, match="has no tpu lowering"):
        dispatch.run_unlowered(sig, [torch.ones(8, device="tpu"), [0], 0, True])


@pytest.mark.parametrize("text,value", [("1", True), ("True", True), ("YES", True), ("on", True),
                                        ("0", False), ("false", False), ("No", False), ("off", False),
                                        ("", True)])
def test_booleans(monkeypatch, text, value):
    from hf_tpu import settings

    monkeypatch.setenv("HF_TPU_CPU_FALLBACK", text)
    assert settings.get("HF_TPU_CPU_FALLBACK") is value


def test_malformed_boolean_names_variable_and_values(monkeypatch):
    from hf_tpu import settings

    monkeypatch.setenv("HF_TPU_CHECK_INDICES", "maybe")
    with pytest.raises(ValueError, match=r"HF_TPU_CHECK_INDICES='maybe': expected a boolean: 1/0, true/false, "
                                         r"yes/no, on/off"):
        settings.get("HF_TPU_CHECK_INDICES")


@pytest.mark.parametrize("text", ["0", "abc", "-2", "1.5"])
def test_num_devices_must_be_a_positive_integer(text):
    result = run_python("import hf_tpu", HF_TPU_NUM_DEVICES=text)
    assert result.returncode != 0
    assert f"ValueError: HF_TPU_NUM_DEVICES={text!r}: expected a positive integer" in result.stderr


def test_counts_and_choices(monkeypatch):
    from hf_tpu import settings

    monkeypatch.setenv("HF_TPU_NUM_DEVICES", " 4 ")
    assert settings.get("HF_TPU_NUM_DEVICES") == 4
    monkeypatch.setenv("HF_TPU_EAGER_MODE", "defer_and_fuse")
    assert settings.get("HF_TPU_EAGER_MODE") == "DEFER_AND_FUSE"
    monkeypatch.setenv("HF_TPU_PLATFORM", "TPU")
    assert settings.get("HF_TPU_PLATFORM") == "tpu"
    monkeypatch.setenv("HF_TPU_PLATFORM", "npu")
    with pytest.raises(ValueError, match=r"HF_TPU_PLATFORM='npu': expected one of cpu, gpu, cuda, rocm, tpu"):
        settings.get("HF_TPU_PLATFORM")
    monkeypatch.setenv("HF_TPU_CACHE_DIR", "")
    assert settings.get("HF_TPU_CACHE_DIR") == "" and settings.source("HF_TPU_CACHE_DIR") == "env"


def test_describe_lists_every_variable_the_package_reads(monkeypatch):
    import re

    from hf_tpu import settings

    monkeypatch.setenv("HF_TPU_LOG_COMPILES", "yes")
    monkeypatch.delenv("HF_TPU_CHECK_INDICES", raising=False)
    rows = {row["name"]: row for row in settings.describe()}
    assert rows["HF_TPU_LOG_COMPILES"]["value"] is True and rows["HF_TPU_LOG_COMPILES"]["source"] == "env"
    assert rows["HF_TPU_CHECK_INDICES"]["value"] is False and rows["HF_TPU_CHECK_INDICES"]["source"] == "default"
    read = set()
    for folder in ("hf_tpu", "integrations"):
        for dirpath, _, files in os.walk(os.path.join(ROOT, folder)):
            for name in files:
                if name.endswith(".py"):
                    with open(os.path.join(dirpath, name)) as f:
                        read |= set(re.findall(r"\"(HF_TPU_[A-Z_0-9]+)\"", f.read()))
    assert read <= set(rows), read - set(rows)
    with open(os.path.join(ROOT, "README.md")) as f:
        readme = f.read()
    assert [name for name in rows if f"| `{name}`" not in readme] == []


# --- 3. HF_TPU_PLATFORM=cpu keeps JAX off the accelerator (libtpu's lock when another process has the chip)


def test_platform_cpu_keeps_jax_off_accelerators():
    code = "import hf_tpu, jax; print(jax.config.jax_platforms); print(jax.devices()[0].platform)"
    env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=300,
                            env={**env, "HF_TPU_PLATFORM": "cpu", "HF_TPU_CACHE_DIR": ""})
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["cpu", "cpu"]
