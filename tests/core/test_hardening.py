"""Defects a new user hit: environment settings, version checks, dtype errors, seeds, index checks. Each
test fails on the code before its fix."""

import os
import subprocess
import sys

import pytest
import torch

import hf_tpu
from tests.util import transcendental_tolerance

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
    from hf_tpu.integrations.transformers import settings as _generation  # noqa: F401  (registers its variables)
    from hf_tpu.integrations import sentence_transformers as _encode_settings  # noqa: F401  (its variable)
    from hf_tpu.integrations.accelerate import optimizer as _optimizer_settings  # noqa: F401  (its variable)
    from hf_tpu.integrations.transformers import compiled_buckets as _bucket_settings  # noqa: F401  (its variable)
    from hf_tpu.integrations.transformers import trainer as _trainer_settings  # noqa: F401  (its variable)

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


@pytest.mark.parametrize("name, text, accepted", [
    ("HF_TPU_ENCODE_BUCKETS", "0,-5", "positive lengths separated by commas (e.g. 32,64,128), or empty for none"),
    ("HF_TPU_PROMPT_BUCKETS", "a,b", "positive lengths separated by commas (e.g. 32,64,128), or empty for none"),
    ("HF_TPU_PROMPT_BUCKETS", ",", "positive lengths separated by commas"),
    ("HF_TPU_KERNEL_BLOCK", "100", "a positive multiple of 128"),
    ("HF_TPU_KERNEL_BLOCK", "0", "a positive multiple of 128"),
    ("HF_TPU_COORDINATOR_ADDRESS", "localhost", "host:port, with a port from 1 to 65535"),
    ("HF_TPU_COORDINATOR_ADDRESS", "localhost:99999", "host:port, with a port from 1 to 65535"),
    ("HF_TPU_SLOW_COMPILE_SECONDS", "nan", "a non-negative number of seconds"),
])
def test_every_malformed_value_is_refused_where_it_is_parsed_and_listed_as_such(monkeypatch, name, text, accepted):
    """What a variable accepts is checked when it is parsed, for the adapters' variables too (registered with the
    same parser): a malformed value is never shown as in force and fails later where it is used."""
    import re

    from hf_tpu import settings
    from hf_tpu.integrations.transformers import settings as _generation  # noqa: F401  (registers its variables)
    from hf_tpu.integrations import sentence_transformers as _encode_settings  # noqa: F401  (its variable)

    monkeypatch.setenv(name, text)
    with pytest.raises(ValueError, match=re.escape(f"{name}={text!r}: expected {accepted}")):
        settings.get(name)
    row = {row["name"]: row for row in settings.describe()}[name]
    assert row["error"] is not None and row["value"] == text and row["source"] == "env"


def test_lengths_and_addresses_parse_as_written(monkeypatch):
    import importlib

    from hf_tpu import settings

    generation = importlib.import_module("hf_tpu.integrations.transformers.settings")
    monkeypatch.setenv("HF_TPU_PROMPT_BUCKETS", " 64, 32,64 ")
    assert settings.get("HF_TPU_PROMPT_BUCKETS") == (32, 64) and generation.Settings().prompt_buckets == (32, 64)
    monkeypatch.setenv("HF_TPU_PROMPT_BUCKETS", "")
    assert generation.Settings().prompt_buckets == ()
    monkeypatch.delenv("HF_TPU_PROMPT_BUCKETS")
    assert generation.Settings().prompt_buckets == generation.DEFAULT_PROMPT_BUCKETS
    monkeypatch.setenv("HF_TPU_COORDINATOR_ADDRESS", "10.0.0.2:8476")
    assert settings.get("HF_TPU_COORDINATOR_ADDRESS") == "10.0.0.2:8476"
    monkeypatch.setenv("HF_TPU_KERNEL_BLOCK", "256")
    assert settings.get("HF_TPU_KERNEL_BLOCK") == 256


# --- 3. HF_TPU_PLATFORM=cpu keeps JAX off the accelerator (libtpu's lock when another process has the chip)


def test_platform_cpu_keeps_jax_off_accelerators():
    code = "import hf_tpu, jax; print(jax.config.jax_platforms); print(jax.devices()[0].platform)"
    env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=300,
                            env={**env, "HF_TPU_PLATFORM": "cpu", "HF_TPU_CACHE_DIR": ""})
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["cpu", "cpu"]


def test_platform_cpu_keeps_the_processes_it_starts_off_accelerators_too():
    """A process started from one with HF_TPU_PLATFORM=cpu that uses JAX without hf_tpu (a benchmark's raw
    JAX worker) inherits JAX_PLATFORMS=cpu."""
    child = "import jax; print(jax.config.jax_platforms)"
    code = f"import hf_tpu, subprocess, sys; print(subprocess.run([sys.executable, '-c', {child!r}], " \
           "capture_output=True, text=True).stdout)"
    env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=300,
                            env={**env, "HF_TPU_PLATFORM": "cpu", "HF_TPU_CACHE_DIR": ""})
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["cpu"]


# --- 4. matrix products of mismatched dtypes raise CPU's error


def _error(fn, device):
    try:
        fn(device)
    except Exception as e:  # noqa: BLE001
        return type(e), str(e)
    return None


_F, _B, _H, _L, _D = torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.float64


def _t(*shape, dtype=_F):
    return lambda d: torch.ones(*shape, dtype=dtype, device=d)


_MISMATCHED = {
    "matmul f32 @ int64": lambda d: _t(2, 2)(d) @ _t(2, 2, dtype=_L)(d),
    "matmul bf16 @ f32": lambda d: _t(2, 2, dtype=_B)(d) @ _t(2, 2)(d),
    "matmul 1d @ 1d": lambda d: _t(2)(d) @ _t(2, dtype=_B)(d),
    "matmul 2d @ 1d": lambda d: _t(2, 2)(d) @ _t(2, dtype=_B)(d),
    "matmul 3d @ 2d": lambda d: _t(2, 2, 2, dtype=_B)(d) @ _t(2, 2)(d),
    "matmul 2d @ 3d": lambda d: _t(2, 2, dtype=_B)(d) @ _t(2, 2, 2)(d),
    "mm": lambda d: torch.mm(_t(2, 2, dtype=_L)(d), _t(2, 2)(d)),
    "mm half": lambda d: torch.mm(_t(2, 2)(d), _t(2, 2, dtype=_H)(d)),
    "bmm": lambda d: torch.bmm(_t(1, 2, 2)(d), _t(1, 2, 2, dtype=_B)(d)),
    "addmm mat1": lambda d: torch.addmm(_t(2, 2)(d), _t(2, 2, dtype=_B)(d), _t(2, 2)(d)),
    "addmm mat2": lambda d: torch.addmm(_t(2, 2)(d), _t(2, 2)(d), _t(2, 2, dtype=_B)(d)),
    "addmm self": lambda d: torch.addmm(_t(2, 2, dtype=_D)(d), _t(2, 2, dtype=_B)(d), _t(2, 2)(d)),
    "linear": lambda d: torch.nn.functional.linear(_t(2, 2, dtype=_H)(d), _t(2, 2)(d)),
    "linear bias": lambda d: torch.nn.functional.linear(_t(2, 2)(d), _t(2, 2)(d), _t(2, dtype=_H)(d)),
    "nn.Linear half input": lambda d: torch.nn.Linear(2, 2).to(d)(_t(3, 2, dtype=_H)(d)),
    "nn.Linear 3d input": lambda d: torch.nn.Linear(2, 2).to(d)(_t(2, 3, 2, dtype=_B)(d)),
    "baddbmm batch2": lambda d: torch.baddbmm(_t(1, 2, 2)(d), _t(1, 2, 2)(d), _t(1, 2, 2, dtype=_B)(d)),
    "baddbmm self": lambda d: torch.baddbmm(_t(1, 2, 2, dtype=_B)(d), _t(1, 2, 2)(d), _t(1, 2, 2)(d)),
    "addbmm": lambda d: torch.addbmm(_t(2, 2)(d), _t(1, 2, 2, dtype=_B)(d), _t(1, 2, 2)(d)),
    "addmv": lambda d: torch.addmv(_t(2)(d), _t(2, 2)(d), _t(2, dtype=_B)(d)),
    "addmv self": lambda d: torch.addmv(_t(2, dtype=_B)(d), _t(2, 2)(d), _t(2)(d)),
    "mv": lambda d: torch.mv(_t(2, 2)(d), _t(2, dtype=_L)(d)),
    "mv mat": lambda d: torch.mv(_t(2, 2, dtype=_B)(d), _t(2)(d)),
    "dot": lambda d: torch.dot(_t(2)(d), _t(2, dtype=_B)(d)),
    "vdot": lambda d: torch.vdot(_t(2, dtype=_L)(d), _t(2)(d)),
}


@pytest.mark.parametrize("name", list(_MISMATCHED))
def test_matrix_products_of_mismatched_dtypes_raise_cpus_error(name):
    fn = _MISMATCHED[name]
    expected = _error(fn, "cpu")
    assert expected is not None
    actual = _error(lambda d: fn(d).cpu(), "tpu")
    assert actual == expected


def test_matrix_products_of_one_dtype_still_compute():
    x = torch.arange(6.0).reshape(2, 3)
    assert torch.equal((x.to("tpu") @ x.t().to("tpu")).cpu(), x @ x.t())
    b = torch.ones(2, 2, 2, dtype=torch.bfloat16)
    assert torch.equal(torch.baddbmm(b.to("tpu"), b.to("tpu"), b.to("tpu")).cpu(), torch.baddbmm(b, b, b))


# --- 5. seeds out of PyTorch's range raise as on CPU


@pytest.mark.parametrize("seed", [2**70, 2**64, -(2**63) - 1])
def test_seed_out_of_range_raises_like_cpu(seed):
    with pytest.raises(ValueError, match="^Overflow when unpacking long long$"):
        torch.Generator().manual_seed(seed)
    before = torch.tpu.initial_seed()
    for fn in (torch.tpu.manual_seed, torch.tpu.manual_seed_all, torch.manual_seed):
        with pytest.raises(ValueError, match="^Overflow when unpacking long long$"):
            fn(seed)
    assert torch.tpu.initial_seed() == before


@pytest.mark.parametrize("seed", [-1, -(2**63), 2**64 - 1, 2**63, 7])
def test_seed_in_range_is_taken_as_on_cpu(seed):
    torch.tpu.manual_seed(seed)
    assert torch.tpu.initial_seed() == torch.Generator().manual_seed(seed).initial_seed()
    torch.manual_seed(seed)
    assert torch.tpu.initial_seed() == torch.initial_seed()


# --- 7. class labels and bincount's values are checked like indices


def _checked_error(fn, monkeypatch, how):
    if how == "env":
        monkeypatch.setenv("HF_TPU_CHECK_INDICES", "1")
        return _error(lambda d: fn(d).cpu(), "tpu")
    with torch.tpu.use_eager_mode("DEFER_NEVER_AND_LAUNCH_BLOCKING"):
        return _error(lambda d: fn(d).cpu(), "tpu")


_x = torch.randn(3, 5)
_LABELS = {
    "cross_entropy": lambda d: torch.nn.functional.cross_entropy(_x.to(d), torch.tensor([1, 9, 2], device=d)),
    "cross_entropy negative": lambda d: torch.nn.functional.cross_entropy(_x.to(d), torch.tensor([1, -3, 7], device=d)),
    "cross_entropy smoothing": lambda d: torch.nn.functional.cross_entropy(
        _x.to(d), torch.tensor([1, 9, 2], device=d), label_smoothing=0.1),
    "nll_loss sum": lambda d: torch.nn.functional.nll_loss(_x.to(d), torch.tensor([1, 7, 9], device=d), reduction="sum"),
    "nll_loss 1d": lambda d: torch.nn.functional.nll_loss(_x[0].to(d), torch.tensor(9, device=d)),
    "nll_loss2d": lambda d: torch.nn.functional.nll_loss(torch.ones(2, 5, 3, 3, device=d),
                                                         torch.full((2, 3, 3), 7, device=d)),
    "nll_loss 3d": lambda d: torch.nn.functional.nll_loss(torch.ones(2, 5, 3, device=d), torch.full((2, 3), 5, device=d)),
    "bincount negative": lambda d: torch.bincount(torch.tensor([1, -2, 3], device=d)),
}


@pytest.mark.parametrize("how", ["env", "launch_blocking"])
@pytest.mark.parametrize("name", list(_LABELS))
def test_out_of_range_labels_raise_cpus_error_when_checked(name, how, monkeypatch):
    expected = _error(_LABELS[name], "cpu")
    assert expected is not None
    assert _checked_error(_LABELS[name], monkeypatch, how) == expected


@pytest.mark.parametrize("how", ["env", "launch_blocking"])
def test_ignored_and_in_range_labels_still_compute_when_checked(how, monkeypatch):
    fns = [lambda d: torch.nn.functional.nll_loss(_x.to(d), torch.tensor([1, 9, 0], device=d), ignore_index=9),
           lambda d: torch.nn.functional.cross_entropy(_x.to(d), torch.tensor([1, 4, -100], device=d)),
           lambda d: torch.bincount(torch.tensor([1, 0, 3], device=d))]
    for fn in fns:
        expected = fn("cpu")
        if how == "env":
            monkeypatch.setenv("HF_TPU_CHECK_INDICES", "1")
            actual = fn("tpu").cpu()
        else:
            with torch.tpu.use_eager_mode("DEFER_NEVER_AND_LAUNCH_BLOCKING"):
                actual = fn("tpu").cpu()
        torch.testing.assert_close(actual, expected, **transcendental_tolerance())


# --- 8. safetensors refuses the string "tpu" in its Rust core: the device index works (README)


def test_safetensors_load_to_tpu_by_device_index(tmp_path):
    safetensors_torch = pytest.importorskip("safetensors.torch")
    from safetensors import safe_open

    path = str(tmp_path / "w.safetensors")
    safetensors_torch.save_file({"a": torch.arange(6.0).reshape(2, 3)}, path)
    for index in range(min(2, torch.tpu.device_count())):  # the second chip, where there is one
        loaded = safetensors_torch.load_file(path, device=index)["a"]
        assert loaded.device == torch.device("tpu", index)
        assert torch.equal(loaded.cpu(), torch.arange(6.0).reshape(2, 3))
        with safe_open(path, framework="pt", device=index) as f:
            assert f.get_tensor("a").device == torch.device("tpu", index)
    moved = {k: v.to("tpu") for k, v in safetensors_torch.load_file(path).items()}
    assert moved["a"].device.type == "tpu"


def test_malformed_variable_fails_at_import_not_at_first_use():
    result = run_python("import hf_tpu", HF_TPU_LOG_COMPILES="2")
    assert result.returncode != 0
    assert "ValueError: HF_TPU_LOG_COMPILES='2': expected a boolean" in result.stderr


# --- 9. a garbage collection in the middle of a trace's walk over the live buffers freed a tensor under it
# ("dictionary changed size during iteration", seen once in a CI run)


def test_a_collection_that_frees_tpu_tensors_while_a_trace_walks_the_live_buffers_is_harmless():
    import gc

    # strict eager: the walks are the same in each mode, and dropping deferred results starts more collections
    # than a pool of tensors to drop would last
    with torch.tpu.use_eager_mode("DEFER_NEVER"):
        weight = torch.randn(4, 4, device="tpu")
        x = torch.randn(2, 4, device="tpu")
        doomed = [torch.ones(1, device="tpu") for _ in range(5000)]

        def free_one(phase, info):  # in place of a cycle that a collection of the middle generation frees
            if phase == "start" and info["generation"] == 1 and len(doomed) > 1:  # however many buffers are live
                doomed.pop()

        threshold = gc.get_threshold()
        gc.callbacks.append(free_one)
        # a young collection every other allocation, the middle one's every 22: in the walks too
        gc.set_threshold(1, 10)
        try:
            actual = hf_tpu.jit(lambda x: torch.tanh(x @ weight))(x)
        finally:
            gc.set_threshold(*threshold)
            gc.callbacks.remove(free_one)
    assert len(doomed) < 5000, "collections freed tensors during the trace"
    torch.testing.assert_close(actual.cpu(), torch.tanh(x.cpu() @ weight.cpu()))
