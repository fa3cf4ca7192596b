"""Running a bound call: where the C entry (`_entry.c`) hands every call it does not launch itself.

`run_bound` picks the op's handler, its lowering (`run_lowered`: analyse the call, find or build its
program, run it through the current execution mode, wrap the results as tensors) or the fallback.
"""

from __future__ import annotations

import torch

from .. import counters, dtypes, modes
from ..device_state import current, rng
from ..memory import buffer, placement
from ..memory.out_of_memory import check_allocation, check_results
from ..modes import device_errors
from . import index_checks
from .call import Call
from .fallback import run_unlowered
from .program import PROGRAMS, build_program, eval_specs, meta_out_specs
from .signatures import GENERATOR, Signature
from .write_checks import check_writable

_counters = counters.counters
_current_mode = modes.current_cell()
# the allocator's new tensor: (shape, dtype, device index, array) -> (tensor, buffer)
allocate = buffer.allocator.new_tensor

def run_lowered(sig: Signature, values: list, analysed=None):
    """Run an op that has a lowering (directly or through its functional overload)."""
    if sig.check is not None:
        sig.check(values)
    call = Call(sig, values, analysed)
    if sig.mutated:
        check_writable(call)
        if _resize_outs(call):  # PyTorch checks the out= tensors it resized (sharing their storage still)
            check_writable(call)
    mode = _current_mode[0]
    program = PROGRAMS.get(call.key)
    new = program is None
    if new:
        program = build_program(call)
        if not program.data_dependent and mode.kind is modes.ModeKind.DEFER_AND_FUSE:
            # trace once now, so a lowering's error surfaces at the user's op, not at a later flush
            eval_specs(program.fn, call, program.index_check is not None)
    _counters["ops_dispatched"] += 1
    device_index = call.device_index
    if device_index is None:  # a factory (zeros, randn, ...): refused at once beyond the device's memory
        device_index = _factory_device(sig, values)
        check_allocation(program.result_bytes, device_index, lambda: f"{sig.name} of {_result_shapes(program)}")
    elif program.large_result_bytes:  # so is an op's large result, before its launch
        check_results(program.large_result_bytes, device_index,
                      buffer.sharded_arrays_exist and any(map(buffer.may_be_sharded, call.arrays)),
                      lambda: f"{sig.name} of {_result_shapes(program)}")
    rng_key = random_key(device_index, _generator_arg(sig, values)) if call.rng else None
    index_check = program.index_check
    if program.data_dependent:
        modes.host_read(f"{sig.name} has a data-dependent output shape")
        arrays = [op.buf.value() if op.buf is not None else op.view for op in call.operands]
        if index_check is not None:  # its program reads its site, and reads and writes the device's record of errors
            arrays = [*arrays, *device_errors.operands(mode, device_index, sig, index_check.error)]
        if buffer.sharded_arrays_exist:
            arrays = placement.place_together(arrays)
        results = program.fn(arrays, call.scalars, rng_key)
        if index_check is not None:  # computed at once, after a sync: checked at the call
            device_errors.keep(mode, device_index, results[-1])
            device_errors.report(at_the_call=True)
            results = results[:-1]
        out_specs = [(tuple(r.shape), dtypes.to_torch(r.dtype)) for r in results]
    else:
        arrays = call.arrays
        if index_check is not None:
            if mode.kind is modes.ModeKind.TRACE and index_checks.in_range_on_host(
                    index_check, sig.names, values):
                index_check = None  # decided in the trace: the program's check is computed into nothing
                arrays = [*arrays, *device_errors.unrecorded()]
            else:
                arrays = [*arrays, *device_errors.operands(mode, device_index, sig, index_check.error)]
        if buffer.sharded_arrays_exist:  # a sharded tensor (hf_tpu.distributed) may meet single-chip ones
            arrays = placement.place_together(arrays)
        results = mode.execute(program, call.key, arrays, call.scalars, rng_key, device_index)
        if program.index_check is not None:
            if index_check is not None:
                device_errors.keep(mode, device_index, results[-1])
            results = results[:-1]
        out_specs = program.out_specs
    if new:  # kept once it has run: a lowering that rejects its arguments raises in every mode
        PROGRAMS[call.key] = program
    only = program.single_result_spec
    if only is not None:
        returned = allocate(only[0], only[1], device_index, results[0])[0]
    else:
        returned = _returned(sig, values, call, program, out_specs, results, device_index)
    if index_check is not None and device_errors.check_at_each_op(mode):
        modes.host_read(f"{sig.name} checks its indices at its call", at_the_call=True)
    return returned


def _returned(sig: Signature, values: list, call: Call, program, out_specs, results, device_index: int):
    """What the op returns, its results made tensors (or written into the buffers it overwrites)."""
    outputs = []
    for spec, array in zip(out_specs, results):
        if spec[0] == "mutated":
            operand = call.operands[spec[1]]
            operand.buf.array = array
            outputs.append(operand.tensor)
        else:  # spec[0] is a tuple of ints already: straight to the allocator
            outputs.append(allocate(spec[0], spec[1], device_index, array)[0])
    if sig.written is not None:  # it returns the arguments it wrote that its schema returns, if any
        returned = [values[i] for i in sig.returns_mutated]
        return None if not returned else returned[0] if len(returned) == 1 else tuple(returned)
    if program.some_undefined:
        produced = iter(outputs)
        outputs = [next(produced) if defined else None for defined in program.defined]
    if sig.returns_list:
        return outputs
    if sig.num_returns == 1:
        return outputs[0]
    if sig.num_returns == 0:
        return None
    return tuple(outputs)


def _generator_arg(sig, values):
    for kind, v in zip(sig.kinds, values):
        if kind == GENERATOR:
            return v
    return None


def _result_shapes(program) -> str:
    return ", ".join(f"{spec[0]} {spec[1]}" for spec in program.out_specs or () if spec[0] != "mutated")


def _factory_device(sig: Signature, values) -> int:
    for name, v in zip(sig.names, values):
        if name == "device" and v is not None:
            return current.current_index_for(torch.device(v))
    return current.current_device_index()


def _resize_outs(call: Call) -> bool:
    """out= tensors of the wrong shape are resized first, as PyTorch does. Whether any was."""
    sig = call.sig
    if sig.functional is None or sig.op._schema.name.endswith("_"):
        return False
    specs = meta_out_specs(call)
    if specs is None:
        return False
    resized = False
    for j, target in enumerate(sig.returns_mutated):
        if target is None:
            continue
        out = call.values[target]
        shape = specs[j][0]
        if tuple(out.shape) != shape:
            out.resize_(shape)
            resized = True
    # operands changed: analyse again
    fresh = Call(sig, call.values)
    call.operands, call.arrays, call.key = fresh.operands, fresh.arrays, fresh.key
    return resized


def run_bound(sig: Signature, values: list, analysed=None):
    """An op with its arguments bound: where the C entry (`_entry.c`) hands every call it does not
    launch itself, with its analysis of the call if it made one (see `Call`)."""
    if sig.handler is not None:
        return sig.handler(sig, values)
    if sig.lowering is not None:
        return run_lowered(sig, values, analysed)
    return run_unlowered(sig, values)


def random_key(device_index: int, generator=None):
    """Key data for one random op: the device's next offset (or a seed from `generator`), or inside a
    `torch.compile` trace the trace's next key, so tracing draws nothing from the host stream."""
    mode = _current_mode[0]
    if mode.kind is modes.ModeKind.TRACE:
        return mode.random_key(generator)
    return rng.next_key(device_index, generator)
