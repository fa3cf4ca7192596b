"""Test setup: two simulated chips (so multi-device paths run on the CPU), and helpers to run the
same code on cpu and on tpu.

On a machine with a TPU, `HF_TPU_PLATFORM=tpu python -m pytest ...` runs the tests on the chip: a test that
needs more chips than the platform has carries `@pytest.mark.requires_chips(n)` and is skipped there, and a
test that starts a Python process gives it `tests.util.cpu_process_env()` (one process at a time holds a
chip: libtpu's lock)."""

import gc
import os
import warnings

os.environ.setdefault("HF_TPU_NUM_DEVICES", "2")
os.environ.setdefault("HF_TPU_PLATFORM", "cpu")

import pytest  # noqa: E402

import hf_tpu  # noqa: E402,F401


def pytest_configure(config):
    config.addinivalue_line("markers", "requires_chips(n): needs n tpu devices (the CPU platform simulates "
                            "HF_TPU_NUM_DEVICES of them; a TPU machine has its own); skipped with fewer")


def pytest_sessionfinish(session, exitstatus):
    """The heap's garbage collected now, and what is left alive frozen out of later collections. pytest collects
    garbage twice more at its unconfigure, to find objects whose finalizers raised; a run of the whole suite
    leaves each xdist worker a heap of traced programs and models whose full collection took over 5 s, and
    past 5 s after the controller asks a worker to end, execnet interrupts it with SIGINT (a KeyboardInterrupt
    raised inside a gc callback, reported as a PytestUnraisableExceptionWarning). Collected here, before the
    worker reports its end, the same work is off that clock; frozen, the heap is not walked again."""
    gc.collect()
    gc.freeze()


def pytest_collection_modifyitems(config, items):
    chips = hf_tpu.platform.device_count()
    for item in items:
        marker = item.get_closest_marker("requires_chips")
        if marker is not None and chips < marker.args[0]:
            item.add_marker(pytest.mark.skip(
                reason=f"needs {marker.args[0]} tpu chips; platform {hf_tpu.platform_name()} has {chips}"))


@pytest.fixture(autouse=True)
def _fresh_metrics():
    hf_tpu.reset_metrics()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        yield
