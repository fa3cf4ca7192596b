"""Transformers' testing_utils on `tpu` (TRANSFORMERS_TEST_DEVICE=tpu, TRANSFORMERS_TEST_BACKEND=hf_tpu), and the
runner that compares Transformers' tests on cpu and tpu (benchmarks/transformers_suite.py).

testing_utils reads the environment when it is imported, so each check runs in a fresh interpreter."""

import json
import os
import subprocess
import sys
import textwrap

import pytest

from benchmarks import transformers_suite

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run_with_test_device(device: str, code: str) -> dict:
    environment = {key: value for key, value in os.environ.items() if not key.startswith("TRANSFORMERS_TEST_")}
    environment.update(transformers_suite.DEVICE_ENVIRONMENTS[device])
    completed = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=environment, cwd=REPO_ROOT,
                               capture_output=True, text=True, timeout=300)
    assert completed.returncode == 0, completed.stderr[-3000:]
    return json.loads(completed.stdout.strip().splitlines()[-1])


def test_testing_utils_device_functions_work_on_tpu():
    result = _run_with_test_device("tpu", """
        import json, torch
        from transformers import testing_utils as tu

        tu.backend_manual_seed(tu.torch_device, 3)
        first = torch.randn(4, device=tu.torch_device).cpu()
        tu.backend_manual_seed(tu.torch_device, 3)
        second = torch.randn(4, device=tu.torch_device).cpu()
        tu.backend_empty_cache(tu.torch_device)
        tu.backend_synchronize(tu.torch_device)
        tu.backend_reset_peak_memory_stats(tu.torch_device)
        accelerator_module = tu.backend_torch_accelerator_module(tu.torch_device)
        alive = torch.ones(4, device=tu.torch_device)
        print(json.dumps({
            "torch_device": tu.torch_device,
            "seeded_draws_repeat": torch.equal(first, second),
            "device_count": tu.backend_device_count(tu.torch_device),
            "accelerator_module_is_torch_tpu": accelerator_module is torch.tpu,
            "memory_allocated": accelerator_module.memory_allocated(),
            "accelerator_tests_run": not getattr(tu.require_torch_accelerator(lambda: None),
                                                 "__unittest_skip__", False),
        }))
    """)
    assert result["torch_device"] == "tpu"
    assert result["seeded_draws_repeat"]
    assert result["device_count"] == 2
    assert result["accelerator_module_is_torch_tpu"]
    assert result["memory_allocated"] >= 16  # four float32 ones are alive
    assert result["accelerator_tests_run"]


# A test file the runner is checked against, one test per outcome it must count: a test that passes
# everywhere, one that fails only on tpu, one that fails everywhere, one skipped on cpu.
_SUITE = '''
from transformers.testing_utils import torch_device

import pytest


def test_passes_everywhere():
    assert torch_device in ("cpu", "tpu")


def test_fails_only_on_tpu():
    assert torch_device != "tpu", "this one fails on tpu"


def test_fails_everywhere():
    assert False


@pytest.mark.skipif(torch_device == "cpu", reason="accelerator only")
def test_runs_only_on_tpu():
    assert torch_device == "tpu"
'''


def test_suite_counts_cpu_passing_tests_and_groups_tpu_only_failures(tmp_path):
    test_file = tmp_path / "test_tiny_suite.py"
    test_file.write_text(_SUITE)
    runs = [transformers_suite.run_pytest([str(test_file)], device, tmp_path / f"{device}.xml")
            for device in ("cpu", "tpu")]
    comparison = transformers_suite.compare(runs[0].outcomes, runs[1].outcomes)

    assert [test.split("::")[1] for test in comparison.cpu_passed] == ["test_fails_only_on_tpu",
                                                                      "test_passes_everywhere"]
    assert [test.split("::")[1] for test in comparison.tpu_passed] == ["test_passes_everywhere"]
    assert comparison.share == pytest.approx(0.5)
    (message, tests), = comparison.tpu_only_failures.items()
    assert message.startswith("[failed] AssertionError: this one fails on tpu")
    assert tests[0].endswith("::test_fails_only_on_tpu")
    assert "passing on cpu: 2; of those passing on tpu: 1 (50.0%)" in transformers_suite.report(comparison, runs)
