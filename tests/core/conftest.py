"""Every core test runs in strict eager and in defer-and-fuse: the modes must not change semantics."""

import pytest
import torch


@pytest.fixture(autouse=True, params=["DEFER_NEVER", "DEFER_AND_FUSE"])
def eager_mode(request):
    with torch.tpu.use_eager_mode(request.param):
        yield request.param
