"""`torch.compile(module, backend="tpu")` and `module.compile(backend="tpu")`, served by the direct trace.

Dynamo's capture of a model's forward (bytecode analysis, guards, fake-tensor propagation, AOT autograd) takes
most of a first compiled call: on the development CPU, 18 s of an 8-layer Llama's 26 s, where `hf_tpu.jit`'s trace
of the same call takes 1.3 s and gives the same program. So the call of a module compiled with the `tpu` backend
goes first through the direct trace (`hf_tpu.direct`): `module.forward(*args, **kwargs)` traced from Python into
one program, cached per key, with Dynamo's compiled call as the fallback for whatever the trace cannot take (and,
per key, for every later call). What a compiled module must mean is PyTorch's: the same results as the eager
module, and every change between calls that the eager module would see, seen. The direct trace keys what its
program depends on; here it keys more than `hf_tpu.jit` does (`_module_inputs`), and leaves to Dynamo whatever
the program could not mean:

- State: every module's parameters, buffers and tensor attributes are inputs (an optimizer's in-place update is
  read at the next call); a parameter replaced or resized, a module added, `train()`/`eval()` change the key.
- Python attributes: each module's attributes of plain values (a scale, a flag) are keyed, and so are the objects
  and containers its attributes hold (a Transformers `config`: its attention implementation, `use_cache`,
  `output_hidden_states`); the tensors found there are inputs. Dynamo guards on the attributes the forward reads;
  this keys all of them, so a change to one the forward does not read traces again, where Dynamo would not.
- Arguments: tensors and plain values as `hf_tpu.jit` keys them; an object among them (a cache) is state, walked
  for its tensors, and a trace that changes it falls back.
- Hooks: the compiled module's own forward pre-hooks and hooks run outside the trace, eagerly and at every call,
  as `Module._call_impl` runs them. A submodule's hook runs inside the forward, where a program could not replay
  its effects: a module holding one runs through Dynamo, unless an adapter declared the hook's code to act
  within the call (`HOOKS_WITHIN_THE_CALL`). So does a call with a global module hook or a backward hook, or a
  module whose `forward` is an instance attribute (accelerate's offloading hooks replace it).
- Gradients: a call with gradients enabled and a parameter or input that requires them runs through Dynamo,
  whose graph has a backward.
- Not guarded, as under `jax.jit`: globals the forward reads (a tpu tensor reached only through a global is a
  constant of the program), and the contents of objects the walk does not reach (a function's closure).

Inside another trace (a module compiled this way, called by a function `hf_tpu.jit` traces, or by a larger module
traced directly), the module's forward is traced as part of the enclosing program. `HF_TPU_COMPILE_DIRECT=0`
turns all of this off: every call goes through Dynamo.

First calls: an adapter's quick form (`QUICK_FORMS`; the Transformers adapter's scans a decoder's layers where
`HF_TPU_SCAN_LAYERS=first-calls`) runs a new shape's first calls through a program that compiles sooner, while the
forward's own program, traced at a later call, compiles beside them; then the forward's program serves.

New shapes: an adapter's shape policy (`SHAPE_POLICIES`; the Transformers adapter's pads a causal LM's prompt on
the right) pads a call to its bucket, whose one program serves every shape padded to it, and names other ways to
compute the call; while a bucket's program is not compiled, its calls run those ways on programs that are (a
longer bucket, the rows in chunks), and the bucket is traced once they have cost as long as a trace
(`hf_tpu.jit(meanwhile=)`'s rent-or-buy rule). `torch.compile(..., dynamic=False)` keeps shapes exact.

The hook is `OptimizeContext.__call__`, where both `torch.compile(module)` (through the `OptimizedModule`'s
`forward`) and `Module.compile()` (through `_compiled_call_impl`) wrap the module's call. The `tpu` backend's entry
point (`pyproject.toml`) is this module's `tpu_backend`, so `torch.compile(backend="tpu")` imports it, and the hook
is installed, before it wraps anything (a `torch.compile` given `hf_tpu.compile.tpu_backend` itself, with this module
never imported, compiles through Dynamo). The registries above are the adapters' part of the core's contract.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Callable

import torch

from . import modes, settings
from .wrapping import wrap_once

log = logging.getLogger("hf_tpu.compile")

# a module's own bookkeeping, which its forward does not read: not keyed (its hooks are checked, then watched)
_MODULE_INTERNALS = frozenset((
    "_parameters", "_buffers", "_modules", "training", "_non_persistent_buffers_set", "_is_full_backward_hook",
    "_state_dict_hooks", "_state_dict_pre_hooks", "_load_state_dict_pre_hooks", "_load_state_dict_post_hooks",
    "_forward_hooks_with_kwargs", "_forward_hooks_always_called", "_forward_pre_hooks_with_kwargs",
    "_compiled_call_impl",
))
# the hooks that run around a module's forward, by the attribute holding them
_HOOKS = ("_forward_pre_hooks", "_forward_hooks", "_backward_pre_hooks", "_backward_hooks")

# the code of hooks whose effects stay within the call that runs them, so that a module holding them can be traced
# (an adapter adds its library's: Transformers' output-capturing hooks append to a collector its forward makes)
HOOKS_WITHIN_THE_CALL: set = set()


# the names of module attributes that hold what a forward does not read, left out of the key (an adapter adds its
# library's: Transformers' `generation_config`, whose `_original_object_hash` differs in every process and would
# give the program another name in the disk cache there)
NOT_READ_BY_FORWARD: set = set()


def _hooks_outside_the_call(hooks) -> bool:
    return any(getattr(hook, "__code__", None) not in HOOKS_WITHIN_THE_CALL for hook in hooks.values())


@dataclasses.dataclass
class Bucketing:
    """A call computed as a call of another shape (a bucket: one program serves every call padded to it). `args` and
    `kwargs` are the bucket's inputs, `unpad(result)` the call's result from the bucket's, `shape` the bucket as the
    policy names it (hashable). `alternatives()` yields other ways to compute the call, from calls whose programs
    may be compiled already while the bucket's is not, most preferred first: each (shapes, make, combine), `shapes`
    the policy's names of its calls' buckets, `make()` the calls' (args, kwargs), `combine(results)` the call's
    result from theirs. Asked only while the bucket is not compiled, and made only for shapes that are."""

    args: tuple
    kwargs: dict
    unpad: Callable
    shape: object
    alternatives: Callable


# the functions that pad a compiled call to its bucket (an adapter adds its library's: Transformers' causal LMs):
# each of (module, args, kwargs, dynamic: torch.compile's `dynamic`) returns a `Bucketing`, or None where it cannot
SHAPE_POLICIES: list = []

# the functions that give a compiled call a quicker form to compile (an adapter adds its library's: a Transformers
# decoder's layers scanned into one loop): each of (module, args, kwargs) returns a function of the call's arguments
# computing what `module.forward` computes, through a program XLA compiles sooner and runs slower, or None. The
# first calls of a new shape run that form, and the forward's own program is traced at a later call and compiled
# beside them, then serves every call (`hf_tpu.jit(meanwhile=)`'s rent-or-buy rule, as for a bucket).
QUICK_FORMS: list = []
# `trace_after` while a quick form serves: the first call runs it, and the forward is traced once it has run as long
_QUICK_FIRST = 1e-6


@functools.cache
def _module_inputs():
    """The class walking a compiled module's call: `hf_tpu.jit`'s (`trace_inputs.Inputs`), with every module's Python
    attributes keyed and the objects among them and among the arguments walked as state (see the module's
    docstring). The compiled module is the first state object; its own hooks run outside the trace (`_call`), its
    submodules' inside. Made at the first call: `hf_tpu.direct` imports the tracing machinery, and adapters import
    this module at their library's import for `HOOKS_WITHIN_THE_CALL`."""
    from . import trace_inputs

    class ModuleInputs(trace_inputs.Inputs):
        def _module(self, m: torch.nn.Module):
            key = super()._module(m)
            if key[0] == "seen":
                return key
            attributes = m.__dict__
            if m is not self.state[0]:
                hooks = [attributes[name] for name in _HOOKS if name in attributes]
                if any(map(_hooks_outside_the_call, hooks)):
                    raise trace_inputs.Unkeyable(f"a {type(m).__name__} in it has hooks")
                if "forward" in attributes:
                    raise trace_inputs.Unkeyable(f"a {type(m).__name__} in it has a forward of its own (a hook)")
                self.containers += hooks  # a kept walk is replayed only while they hold what they hold now
            extra = []
            for name, value in attributes.items():
                if (name in _MODULE_INTERNALS or name in _HOOKS or name in NOT_READ_BY_FORWARD
                        or (type(value) is torch.Tensor and name[0] != "_")):  # the tensors `super()._module` keyed
                    continue
                if isinstance(value, trace_inputs.VALUE_TYPES):
                    extra.append((name, type(value), value))
                elif isinstance(value, (torch.Tensor, torch.nn.Module, list, tuple, dict)) \
                        or trace_inputs.plain_object(value):
                    extra.append((name, self.state_object(value, 1)))
            return (*key, tuple(extra))

        def argument(self, x, depth: int = 0):
            if (not isinstance(x, (torch.Tensor, torch.nn.Module)) and trace_inputs.plain_object(x)
                    and id(x) not in self.state_index):
                self.state_index[id(x)] = len(self.state)
                self.state.append(x)
                return ("state", len(self.state) - 1, self.root(x))
            return super().argument(x, depth)

        def root(self, x):
            """A kept walk is the compiled module's (the first state object, whose own hooks are not checked): another
            object's walk is made at every call."""
            return super().root(x) if x is self.state[0] else self.state_object(x)

    return ModuleInputs


def enabled() -> bool:
    return settings.get("HF_TPU_COMPILE_DIRECT")


class _CompiledCall:
    """One module's call compiled with the `tpu` backend: its forward traced directly, Dynamo's compiled call
    (`compiled`) where that trace cannot be made.

    `around` says whether `compiled` is the module's whole call (`torch.compile(module)`, `module.compile()`),
    whose own forward hooks then run here, eagerly and at every call as `Module._call_impl` runs them, around the
    traced forward; or its forward alone (`torch.compile(module.forward)`), whose hooks run outside it."""

    def __init__(self, module: torch.nn.Module, forward, compiled, dynamo_compile, around: bool, dynamic=None):
        self.module = module
        self.dynamic = dynamic  # torch.compile's: False keeps every shape exact (no bucket)
        self.forward = forward
        self.compiled = compiled
        self.dynamo_compile = dynamo_compile  # Dynamo's compile of a function, in the context that made `compiled`
        self.around = around
        self.compiled_forward = None  # Dynamo's compile of the forward alone, for a module with hooks of its own
        self.compiled_shapes = set()  # the buckets (`Bucketing.shape`) whose programs ran

    def __call__(self, args: tuple, kwargs: dict):
        module = self.module
        if modes.current().kind is modes.ModeKind.TRACE:  # inside another trace: part of its program
            return (module._call_impl if self.around else self.forward)(*args, **kwargs)
        if (torch.compiler.is_compiling() or not enabled() or torch.nn.modules.module._has_any_global_hook()
                or (self.around and "forward" in module.__dict__) or _needs_gradients(module, args, kwargs)):
            return self.compiled(*args, **kwargs)
        if not self.around or not (module._forward_pre_hooks or module._forward_hooks):
            return self._traced(args, kwargs, self.compiled)
        if module._backward_hooks or module._backward_pre_hooks:
            return self.compiled(*args, **kwargs)
        args, kwargs = _forward_pre_hooks(module, args, kwargs)
        if self.compiled_forward is None:
            self.compiled_forward = self.dynamo_compile(self.forward)
        result = self._traced(args, kwargs, self.compiled_forward)
        return _forward_hooks(module, args, kwargs, result)

    def _traced(self, args: tuple, kwargs: dict, fallback):
        """The forward traced directly, padded to its bucket where a shape policy gives one (`SHAPE_POLICIES`), its
        first calls in a quick form where an adapter gives one (`QUICK_FORMS`)."""
        bucketing = next((b for b in (policy(self.module, args, kwargs, self.dynamic) for policy in SHAPE_POLICIES)
                          if b is not None), None)
        quick = next((q for q in (policy(self.module, args, kwargs) for policy in QUICK_FORMS) if q is not None), None)
        if bucketing is None:
            if quick is None:
                return _traced_call(self.forward, args, kwargs, self.module, fallback)
            bucketing = Bucketing(args, kwargs, lambda result: result, None, lambda: ())  # the call's own shape
        from . import direct

        def meanwhile(*_args, **_kwargs):
            """While the bucket's program is not compiled: the call from programs that are, if any. The buckets whose
            programs ran are noted (`compiled_shapes`): only an alternative of such buckets is made, and its calls'
            keys checked (`direct.ready`)."""
            for shapes, make, combine in bucketing.alternatives():
                if all(shape in self.compiled_shapes for shape in shapes):
                    calls = make()
                    if all(_ready(self.forward, a, k, self.module) for a, k in calls):
                        return _Served(combine([_traced_call(self.forward, a, k, self.module, fallback)
                                                for a, k in calls]))
            if quick is not None:  # the bucket's call in its quick form
                return _Served(bucketing.unpad(_traced_call(quick, _args, _kwargs, self.module, fallback)))
            return NotImplemented

        result = direct.call(self.forward, bucketing.args, bucketing.kwargs, (self.module,), fallback, meanwhile,
                             0.0 if quick is None else _QUICK_FIRST, _module_inputs())
        if isinstance(result, _Served):
            return result.result
        if bucketing.shape not in self.compiled_shapes and _ready(self.forward, bucketing.args, bucketing.kwargs,
                                                                  self.module):
            self.compiled_shapes.add(bucketing.shape)
        return bucketing.unpad(result)


@dataclasses.dataclass
class _Served:
    """A bucketed call's result computed from other shapes' programs (`_CompiledCall._traced`), not the bucket's."""

    result: object


def _ready(forward, args: tuple, kwargs: dict, module: torch.nn.Module) -> bool:
    from . import direct

    return direct.ready(forward, args, kwargs, (module,), _module_inputs())


def _traced_call(forward, args: tuple, kwargs: dict, module: torch.nn.Module, fallback):
    from . import direct

    return direct.call(forward, args, kwargs, (module,), fallback, inputs_type=_module_inputs())


def _needs_gradients(module: torch.nn.Module, args: tuple, kwargs: dict) -> bool:
    """Whether the call builds an autograd graph (gradients enabled, and a parameter or tensor argument that requires
    them): Dynamo's, whose graph has a backward. Asked before the walk, which would refuse it at every call."""
    if not torch.is_grad_enabled():
        return False
    return any(p.requires_grad for p in module.parameters()) or any(
        isinstance(a, torch.Tensor) and a.requires_grad for a in (*args, *kwargs.values()))


def _forward_pre_hooks(module: torch.nn.Module, args: tuple, kwargs: dict) -> tuple:
    """(args, kwargs) after the module's forward pre-hooks, as `Module._call_impl` runs them."""
    for hook_id, hook in module._forward_pre_hooks.items():
        if hook_id in module._forward_pre_hooks_with_kwargs:
            result = hook(module, args, kwargs)
            if result is not None:
                if not (isinstance(result, tuple) and len(result) == 2):
                    raise RuntimeError(f"forward pre-hook must return None or a tuple of (new_args, new_kwargs), "
                                       f"but got {result}.")
                args, kwargs = result
        else:
            result = hook(module, args)
            if result is not None:
                args = result if isinstance(result, tuple) else (result,)
    return args, kwargs


def _forward_hooks(module: torch.nn.Module, args: tuple, kwargs: dict, result):
    """The module's result after its forward hooks, as `Module._call_impl` runs them."""
    for hook_id, hook in module._forward_hooks.items():
        if hook_id in module._forward_hooks_with_kwargs:
            hook_result = hook(module, args, kwargs, result)
        else:
            hook_result = hook(module, args, result)
        if hook_result is not None:
            result = hook_result
    return result


def _traced_first(call: _CompiledCall):
    """The call that `torch.compile` returns, behind the direct trace. It keeps what Dynamo set on its own wrapper
    (`_torchdynamo_inline`, `_torchdynamo_orig_callable`, `get_compiler_config`), so that Dynamo tracing a
    function that calls it inlines the module as it would, and `torch.compile` of it again finds the original."""

    @functools.wraps(call.compiled)
    def compiled_call(*args, **kwargs):
        return call(args, kwargs)

    compiled_call._torchdynamo_wrapper_id = id(compiled_call)
    compiled_call._is_torch_compile = True
    return compiled_call


def _module_called(fn) -> tuple:
    """(the module, whether `fn` is its whole call) where `fn` is a module's call (`module.__call__`,
    `module._call_impl`: what `OptimizedModule` and `Module.compile()` compile) or its class's forward
    (`torch.compile(module.forward)`); (None, False) otherwise."""
    wrapped = getattr(fn, "__wrapped__", None)
    if isinstance(wrapped, torch.nn.Module) and getattr(fn, "__code__", None) is _wrap_inline_code():
        return wrapped, True  # an `OptimizedModule` of a torch.nn module calls it through Dynamo's `wrap_inline`
    module = getattr(fn, "__self__", None)
    function = getattr(fn, "__func__", None)
    if not isinstance(module, torch.nn.Module) or function is None:
        return None, False
    if function in (torch.nn.Module.__call__, torch.nn.Module._call_impl):
        return module, True
    forward = type(module).forward
    return (module, False) if function is getattr(forward, "__func__", forward) else (None, False)


@functools.cache
def _wrap_inline_code():
    from torch._dynamo import external_utils

    return external_utils.wrap_inline(lambda: None).__code__


def _compiles_for_tpu(context) -> bool:
    """Whether a Dynamo context compiles with the `tpu` backend (by name or as one of its functions)."""
    from torch._dynamo.eval_frame import innermost_backend

    from .compile import tpu_backend as backend_itself

    backend = innermost_backend(context.callback) if callable(getattr(context, "callback", None)) else None
    return (getattr(backend, "compiler_fn", backend) in (tpu_backend, backend_itself)
            and not getattr(context, "export", False))


def tpu_backend(gm, example_inputs, **kwargs):
    """`torch.compile(backend="tpu")`'s backend: `hf_tpu.compile.tpu_backend`, reached through this module so that
    loading the backend installs the direct trace in front of it."""
    from .compile import tpu_backend as backend

    return backend(gm, example_inputs, **kwargs)


def install() -> None:
    """`torch.compile` of a module's call with the `tpu` backend returns it behind the direct trace (`wrap`); once."""
    from torch._dynamo.eval_frame import OptimizeContext

    def behind_the_direct_trace(original):
        def __call__(self, fn):
            return wrap(self, fn, original(self, fn), original)

        return __call__

    wrap_once(OptimizeContext, "__call__", behind_the_direct_trace)


def wrap(context, fn, compiled, dynamo_call):
    """What `torch.compile` returns for `fn` (`OptimizeContext.__call__`, wrapped by `install`; `dynamo_call` is
    PyTorch's own, `compiled` what it returned): a module's call compiled with the `tpu` backend behind the direct
    trace, anything else as Dynamo compiled it."""
    module, around = _module_called(fn)
    if module is None or not _compiles_for_tpu(context):
        return compiled
    forward = module.forward if around else fn
    return _traced_first(_CompiledCall(module, forward, compiled, lambda f: dynamo_call(context, f), around,
                                       getattr(context, "_dynamic", None)))


install()
