"""Test setup: two simulated chips (so multi-device paths run on the CPU), and helpers to run the
same code on cpu and on tpu."""

import os
import warnings

os.environ.setdefault("HF_TPU_NUM_DEVICES", "2")
os.environ.setdefault("HF_TPU_PLATFORM", "cpu")

import pytest  # noqa: E402

import hf_tpu  # noqa: E402,F401


@pytest.fixture(autouse=True)
def _fresh_metrics():
    hf_tpu.reset_metrics()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        yield
