"""The C entry of strict eager (`hf_tpu/dispatch/_entry.c`): its analysis of a call gives what
`dispatch.call.Call`'s general loop gives, and it takes the calls it is for. A drift between the two
would compile a program twice or, worse, reuse one for a call it does not fit."""

import functools

import pytest
import torch

import hf_tpu
from hf_tpu import dispatch
from hf_tpu.dispatch import call as calls
from hf_tpu.dispatch import program as programs
from hf_tpu.dispatch import signatures

aten = torch.ops.aten


def _calls():
    a = torch.randn(4, 6, device="tpu")
    b = torch.randn(4, 6, device="tpu")
    w = torch.randn(6, 3, device="tpu")
    # (name, op, values in schema order, whether the C path takes it)
    return [
        ("add, default alpha", aten.add.Tensor, [a, b, 1], True),
        ("add, alpha=2", aten.add.Tensor, [a, b, 2], False),
        ("add, alpha=1.0", aten.add.Tensor, [a, b, 1.0], False),
        ("mm", aten.mm.default, [a, w], True),
        ("sum over a dim list", aten.sum.dim_IntList, [a, [1], True, None], True),
        ("softmax", aten._softmax.default, [a, -1, False], True),
        ("leaky_relu, default slope", aten.leaky_relu.default, [a, 0.01], True),
        ("leaky_relu, other slope", aten.leaky_relu.default, [a, 0.2], False),
        ("a transposed copy, transposed back", aten.add.Tensor, [a.t().contiguous().t(), b, 1], False),
        ("a copy", aten.add.Tensor, [a.clone(), b, 1], True),
        ("a transposed view", aten.mm.default, [w.t(), a.t()], False),
        ("a sliced view", aten.add.Tensor, [a[1:], b[1:], 1], False),
        ("a Python number", aten.mul.Tensor, [a, 3], False),
        ("a CPU scalar tensor", aten.mul.Tensor, [a, torch.tensor(3.0)], False),
        ("an optional tensor left out", aten.addmm.default, [torch.zeros(3, device="tpu"), a, w, 1, 1], True),
        ("a tensor list", aten.cat.default, [[a, b], 0], False),
        ("a conjugate view", aten.add.Tensor,
         [torch.randn(3, dtype=torch.cfloat, device="tpu").conj(), torch.randn(3, dtype=torch.cfloat, device="tpu"), 1],
         False),
        ("a generator", aten.bernoulli.default, [torch.rand(3, device="tpu"), None], False),
    ]


@pytest.mark.parametrize("index", range(len(_calls())), ids=[c[0] for c in _calls()])
def test_c_fast_path_gives_the_general_loops_analysis(index, monkeypatch):
    _, op, values, taken = _calls()[index]
    sig = dispatch.signature(op)
    common = calls._analyse_common(sig.kinds, sig.defaults, sig.default_keys, values, sig.ident,
                                      calls.matmul_precision())
    assert (common is not None) == taken
    if not taken:
        return
    fast = calls.Call(sig, values)
    monkeypatch.setattr(calls, "_analyse_common", lambda *args: None)
    general = calls.Call(sig, values)
    assert fast.key == general.key
    assert fast.operands == general.operands
    assert len(fast.arrays) == len(general.arrays) and all(x is y for x, y in zip(fast.arrays, general.arrays))
    assert (fast.device_index, fast.scalars, fast.rng) == (general.device_index, general.scalars, general.rng)


def test_a_check_of_argument_types_keeps_the_fast_path():
    """`Lowering.type_check` (bool subtraction) runs when a program is built: `sub` stays plain."""
    assert dispatch.signature(aten.sub.Tensor).fast_path_eligible and dispatch.signature(aten.sub.Tensor).lowering.type_check
    assert not dispatch.signature(aten.amax.default).fast_path_eligible  # a per-call check


def test_a_negative_zero_is_not_its_defaults_zero():
    """-0.0 == 0.0 in Python, yet a program with either baked in computes something else."""
    sig = dispatch.signature(aten.add.Tensor)  # any signature: only the key's head comes from it
    args = ((signatures.SCALAR,), (0.0,), (signatures.hashable(0.0),))
    assert calls._analyse_common(*args, [0.0], sig.ident, "highest") is not None
    assert calls._analyse_common(*args, [-0.0], sig.ident, "highest") is None


@pytest.mark.requires_chips(2)
def test_tensors_on_two_chips_take_the_general_loop_and_its_error():
    a, b = torch.ones(3, device="tpu:0"), torch.ones(3, device="tpu:1")
    sig = dispatch.signature(aten.add.Tensor)
    assert calls._analyse_common(sig.kinds, sig.defaults, sig.default_keys, [a, b, 1], sig.ident,
                                    "highest") is None
    with pytest.raises(RuntimeError, match="Expected all tensors to be on the same device"):
        a + b


def test_a_compiled_graphs_whole_buffer_inputs_are_read_in_c_and_the_rest_by_the_general_loop():
    """`_entry.whole_arrays` reads a compiled graph's inputs where each is a whole buffer holding a computed array,
    all on one chip; any other input (a view, a CPU tensor, a size, a deferred value, a second chip) leaves the
    whole call to `CompiledGraph._read_inputs`' loop."""
    from hf_tpu.dispatch import _entry
    from hf_tpu.memory import buffer

    a, w = torch.randn(4, 6, device="tpu"), torch.randn(6, 3, device="tpu", dtype=torch.bfloat16)
    torch.tpu.synchronize()  # computed (a compiled graph syncs before it reads its inputs)
    arrays, specs, device_index = _entry.whole_arrays((a, w))
    assert arrays == [buffer.buffer_of(a).value(), buffer.buffer_of(w).value()]
    assert specs == [(torch.float32, 0), (torch.bfloat16, 0)] and device_index == 0
    other_chip = torch.ones(3, device="tpu:1")
    torch.tpu.synchronize("tpu:1")
    assert _entry.whole_arrays((other_chip,))[1:] == ([(torch.float32, 1)], 1)
    for other in (a[1:], a.t(), torch.ones(3), 3, other_chip):
        assert _entry.whole_arrays((a, other)) is None
    assert _entry.whole_arrays(()) is None
    with torch.tpu.use_eager_mode("DEFER_AND_FUSE"):
        deferred = a + 1
        assert _entry.whole_arrays((a, deferred)) is None
        torch.tpu.synchronize()


def test_a_compiled_graph_reads_views_and_host_tensors_beside_whole_buffers():
    """The general loop's inputs give the eager result: a view and a CPU tensor among whole buffers."""

    def fn(x, y, z):
        return x * 2 + y + z.to(x.device)

    compiled = torch.compile(fn, backend="tpu")
    x, y = torch.randn(4, 6, device="tpu"), torch.randn(5, 6, device="tpu")
    z = torch.randn(4, 6)
    torch.testing.assert_close(compiled(x, x, z).cpu(), fn(x, x, z).cpu())
    torch.testing.assert_close(compiled(x, y[1:], z).cpu(), fn(x, y[1:], z).cpu())


def _python_functions_called(fn) -> set:
    import sys

    called = set()
    sys.setprofile(lambda frame, event, arg: called.add(frame.f_code.co_name) if event == "call" else None)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return called


def test_strict_eager_launches_a_common_call_from_c():
    a, b = torch.randn(4, 6, device="tpu"), torch.randn(4, 6, device="tpu")
    with torch.tpu.use_eager_mode("DEFER_NEVER"):
        expected = (a + b).cpu()  # builds and compiles the program
        before = torch.tpu.memory_allocated()
        called = _python_functions_called(lambda: a + b)
        assert "run_bound" not in called and "run_lowered" not in called
        assert "new_tensor" in called  # the result's storage and buffer are still made by the allocator
        assert torch.tpu.memory_allocated() == before  # the result died with its storage
        counted = hf_tpu.metrics()
        a + b
        now = hf_tpu.metrics()
        assert now["ops_dispatched"] == counted["ops_dispatched"] + 1
        assert now["compile_cache_hits"] == counted["compile_cache_hits"] + 1
        assert now["compile_cache_hits_by_mode"]["DEFER_NEVER"] == counted["compile_cache_hits_by_mode"]["DEFER_NEVER"] + 1
        assert torch.equal((a + b).cpu(), expected)
        # not the common case: the Python path, with the C entry's analysis
        assert "run_lowered" in _python_functions_called(lambda: a.add(b, alpha=2))
    with torch.tpu.use_eager_mode("DEFER_AND_FUSE"):
        assert "run_lowered" in _python_functions_called(lambda: a + b)


def test_a_direct_launch_that_raises_is_made_again_by_pythons_path():
    """XLA's errors (out of memory) are reported in PyTorch's terms by `modes.raise_out_of_memory` on
    the Python path, which makes the launch again; a BaseException (Ctrl-C) is not caught. Every (3,) add
    program made so far is patched: earlier tests in the process may have made others of that shape."""
    a, b = torch.randn(3, device="tpu"), torch.randn(3, device="tpu")
    with torch.tpu.use_eager_mode("DEFER_NEVER"):
        expected = (a + b).cpu()
        direct = {p: p.direct_launch for p in programs.PROGRAMS.values()
                  if p.direct_launch is not None and p.name == "aten::add.Tensor" and p.direct_launch[1] == (3,)}

        def fails(*arrays, error):
            raise error

        def launches_raising(error):
            for program, launch in direct.items():
                program.direct_launch = (functools.partial(fails, error=error), *launch[1:])

        try:
            launches_raising(RuntimeError("XLA failed"))
            assert torch.equal((a + b).cpu(), expected)
            launches_raising(KeyboardInterrupt())
            with pytest.raises(KeyboardInterrupt):
                a + b
        finally:
            for program, launch in direct.items():
                program.direct_launch = launch


def _configure_fails(match, **changes):
    from hf_tpu.dispatch import _entry, registration

    bindings = {**registration.BINDINGS, **changes}
    for name, value in changes.items():
        if value is None:
            del bindings[name]
    with pytest.raises(TypeError, match=match):
        _entry.configure(**bindings)


def test_the_c_entry_checks_every_binding_by_name_at_configure():
    """`_entry.configure` takes the Python objects the C entry uses by name and checks them (and the
    attributes it reads by name) before keeping any: a rename on the Python side fails at import, naming
    what is missing, instead of silently turning the fast path off."""
    import dataclasses

    from hf_tpu.dispatch import _entry, registration

    _configure_fails("'run_bound'", run_bound=None)  # a binding missing
    _configure_fails("'programs'", programs=[])  # of the wrong type
    _configure_fails("unexpected keyword", launch=print)  # a name the C entry does not know
    with pytest.raises(TypeError, match="keyword arguments only"):
        _entry.configure(*registration.BINDINGS.values())

    @dataclasses.dataclass
    class RenamedProgram:  # Program with `direct_launch` renamed
        launch: tuple | None = None

    _configure_fails("'direct_launch'", program_type=RenamedProgram)

    @dataclasses.dataclass
    class RenamedSignature:  # Signature with a field the entry reads renamed
        names: tuple
        defaults: tuple
        kinds: tuple
        keys_of_defaults: tuple
        ident: int
        fast_path_eligible: bool

    _configure_fails("'default_keys'", signature_type=RenamedSignature)
    fields = registration.BINDINGS["entry_fields"]
    _configure_fails("entry_fields", entry_fields=(fields[1], fields[0], *fields[2:]))  # reordered
    _configure_fails("'_array'", buffer_type=type("Buffer", (), {"dtype": 0, "shape": 0, "device_index": 0}))
    _configure_fails("'SCALAR'", kinds={**registration.BINDINGS["kinds"], "SCALAR": 4})
    _configure_fails("'compile_cache_hits'", counters={"ops_dispatched": 0, "compile_cache_hits_by_mode": {}})
    # nothing was kept from the failed calls: the entry still launches a common call from C
    a, b = torch.randn(3, device="tpu"), torch.randn(3, device="tpu")
    with torch.tpu.use_eager_mode("DEFER_NEVER"):
        expected = (a + b).cpu()
        assert "run_bound" not in _python_functions_called(lambda: a + b)
        assert torch.equal((a + b).cpu(), expected)
