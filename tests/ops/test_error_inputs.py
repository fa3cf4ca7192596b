"""PyTorch's own bad-input samples (OpInfo.error_inputs) raise on tpu what they raise on CPU.

Each op_db entry that has error inputs runs them all on `cpu` and on `tpu`; each must raise the same
exception type on both (or run on both: some of OpInfo's generic error inputs run on CPU too).
Messages may differ: PyTorch's CPU kernels and meta kernels word the same check differently.
"""

import pytest
import torch

from tests.ops import opdb

# entries whose error inputs still differ, with the reason (strict: the list can only shrink)
KNOWN = {
    "narrow_copy": "CPU's kernel reports an out-of-range dim as RuntimeError; the meta kernel, as every "
                   "other op, as IndexError",
}


def _entries():
    for op in opdb.all_ops():
        if op.error_inputs_func is None:
            continue
        name = opdb.opinfo_id(op)
        marks = [pytest.mark.xfail(reason=KNOWN[name], strict=True)] if name in KNOWN else []
        yield pytest.param(op, id=name, marks=marks)


def _outcome(op, error_input) -> str:
    sample = error_input.sample_input
    try:
        op.op(sample.input, *sample.args, **sample.kwargs)
        if torch.tpu.is_initialized():
            torch.tpu.synchronize()  # checks on device values report here
    except Exception as e:  # noqa: BLE001 - the type is what is compared
        return type(e).__name__
    return "no error"


@pytest.mark.parametrize("op", _entries())
def test_error_inputs_raise_what_cpu_raises(op):
    on_cpu, on_tpu = list(op.error_inputs("cpu")), list(op.error_inputs("tpu"))
    differing = [
        (error_input.error_regex, expected, actual)
        for error_input, tpu_input in zip(on_cpu, on_tpu)
        if (expected := _outcome(op, error_input)) != (actual := _outcome(op, tpu_input))
    ]
    assert not differing, f"(expected message, cpu, tpu): {differing}"
