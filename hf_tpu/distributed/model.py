"""`shard_model`: tensor parallelism for a user's own model from a Transformers-style plan; `fully_shard`: the
parameters split over the data-parallel axis (FSDP, ZeRO-3), so that a model whose training state does not fit
one chip trains over several.

With GSPMD only the weights need a layout: XLA propagates it through each program and inserts the
collectives (an all-reduce after a rowwise projection). So each plan style is just where a
parameter is split. The input/output layouts that Transformers' styles also name (`colwise_rep`
gathering its output, ...) are left to XLA's propagation: they change where values sit, never the
values.
"""

from __future__ import annotations

import re

import torch
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from .mesh import Mesh, mesh as make_mesh
from .processes import device_count
from .tensors import _check_spec, replicate, shard, sharding

# style -> which dim of a weight (ndim >= 2) is split, and whether a 1-D bias follows it
_SPLIT_OUTPUT = ("colwise", "colwise_rep", "colwise_gather_output", "packed_colwise", "local_colwise")
_SPLIT_INPUT = ("rowwise", "rowwise_rep", "rowwise_split_input", "packed_rowwise", "local_rowwise")
_WHOLE = ("replicate", "replicated_with_grad_allreduce", "local", "sequence_parallel")
_EMBEDDING_DIM = {"embedding_rowwise": 0, "embedding_colwise": 1}
STYLES = _SPLIT_OUTPUT + _SPLIT_INPUT + _WHOLE + tuple(_EMBEDDING_DIM)


def _generic_name(name: str) -> str:
    """`layers.3.mlp.up_proj` -> `layers.*.mlp.up_proj`, as Transformers' plans are keyed."""
    return re.sub(r"\.\d+(\.|$)", lambda m: ".*" + m.group(1), name)


def _split_dim(style: str, param: torch.Tensor, is_bias: bool):
    """The dim of `param` a style splits, or None where the parameter stays whole."""
    if style in _SPLIT_OUTPUT:
        return param.dim() - 1 if is_bias or param.dim() == 1 else param.dim() - 2
    if style in _SPLIT_INPUT:
        return None if is_bias or param.dim() == 1 else param.dim() - 1
    if style in _EMBEDDING_DIM:
        return _EMBEDDING_DIM[style]
    return None


def _plan_entry(plan: dict, param_name: str):
    """The plan key governing a parameter: its own generic name, else its module's (as Transformers)."""
    generic = _generic_name(param_name)
    if generic in plan:
        return generic
    module_name = generic.rsplit(".", 1)[0] if "." in generic else ""
    return module_name if module_name in plan else None


def _generic_plan(plan: dict) -> dict:
    """Plan keys with their numbers as `*`: Diffusers writes `attn.to_out.0` and `ff.net.2` literally."""
    generic = {}
    for key, style in plan.items():
        name = _generic_name(key)
        if generic.get(name, style) != style:
            raise ValueError(f"the plan gives {name} two styles ({generic[name]} and {style}); shard_model "
                             "needs one style per module once layer numbers are read as '*'")
        generic[name] = style
    return generic


def _check_plan(model: torch.nn.Module, plan: dict) -> None:
    unknown_styles = {key: style for key, style in plan.items() if style not in STYLES}
    if unknown_styles:
        raise ValueError(f"unsupported tensor-parallel styles {unknown_styles}; supported: {', '.join(STYLES)}")
    names = {_generic_name(n) for n, _ in [*model.named_modules(), *model.named_parameters()]}
    missing = [key for key in plan if key not in names]
    if missing:
        examples = sorted(n for n in names if n)[:8]
        raise ValueError(
            f"the plan names {missing}, which the model ({type(model).__name__}) does not have; plan keys are "
            f"module or parameter names relative to the model passed, numbers written as '*' (e.g. {examples})"
        )


def _inner_layouts(param: torch.Tensor, mesh: Mesh, spec: tuple) -> dict:
    """The layout of each inner tensor of a tensor subclass (PyTorch's `__tensor_flatten__` protocol: torchao's
    quantized weights, int data and scales) split over `mesh` as `spec` splits the tensor it stands for. Which
    inner dim follows the split, if any, is what the subclass's own slicing says: its first piece (`narrow`) is
    taken, and an inner tensor that shrank along one dim by the number of chips, to the first piece of that dim,
    is split along it; one that did not shrink is whole on every chip (per-row scales under a split of the
    rows' inputs). Anything else raises ValueError."""
    names, _ = param.__tensor_flatten__()
    spec = tuple(spec) + (None,) * (param.dim() - len(tuple(spec)))
    split = [d for d, axis in enumerate(spec) if axis is not None]
    if not split:
        return {name: () for name in names}
    (dim,) = split
    parts = mesh.shape[spec[dim]]
    first = param.narrow(dim, 0, param.shape[dim] // parts)
    layouts = {}
    for name in names:
        whole, piece = getattr(param, name), getattr(first, name)
        shrunk = [d for d in range(whole.dim()) if piece.shape[d] != whole.shape[d]]
        if not shrunk:
            layouts[name] = ()
            continue
        inner_dim = shrunk[0]
        length = piece.shape[inner_dim]
        if (len(shrunk) > 1 or length * parts != whole.shape[inner_dim]
                or not torch.equal(piece.cpu(), whole.narrow(inner_dim, 0, length).cpu())):
            raise ValueError(f"its {name} ({tuple(whole.shape)}) does not split into {parts} even pieces as the "
                             f"{type(param).__name__} splits along dim {dim}")
        layouts[name] = (None,) * inner_dim + (spec[dim],)
    return layouts


def _shard_subclass(param: torch.Tensor, mesh: Mesh, layouts: dict) -> torch.Tensor:
    """A tensor subclass's inner tensors sharded as `layouts` says, in a new object of its type (a CPU parameter),
    or in the object itself (a tpu one, which keeps its identity)."""
    names, context = param.__tensor_flatten__()
    inner = {name: shard(getattr(param, name).detach(), mesh, layouts[name]) for name in names}
    if param.device.type == "tpu":
        for name, sharded in inner.items():
            setattr(param, name, sharded)
        return param
    return type(param).__tensor_unflatten__(inner, context, param.shape, param.stride())


def _swap_in(model: torch.nn.Module, moved: dict, mesh: Mesh) -> None:
    """Put each sharded replacement of a CPU parameter (`moved`, by the id of the one it replaces) where that one
    was, in every module holding it, and replicate every buffer over `mesh`."""
    for module in model.modules():
        for name, param in module._parameters.items():
            if param is not None and id(param) in moved:
                module._parameters[name] = moved[id(param)]
        for name, buf in module._buffers.items():
            if buf is not None:
                module._buffers[name] = replicate(buf, mesh)


def _chosen_axis(mesh: Mesh, axis: str | None, default: str, argument: str) -> str:
    """The mesh axis a call splits over: `axis`, or the one named `default`, or a 1-D mesh's only axis; a
    ValueError naming the call's `argument` where none fits."""
    if axis is None:
        if len(mesh.axis_names) != 1 and default not in mesh.axis_names:
            raise ValueError(f"the mesh {mesh} has several axes and none named {default!r}: pass {argument}=")
        axis = default if default in mesh.axis_names else mesh.axis_names[0]
    if axis not in mesh.axis_names:
        raise ValueError(f"{argument}={axis!r} is not an axis of the mesh {mesh}")
    return axis


def shard_model(model: torch.nn.Module, plan: dict, mesh: Mesh | None = None, tp_axis: str | None = None):
    """Split `model`'s parameters over the `tp_axis` of `mesh` (default: a 1-D mesh over every chip of
    every process) as `plan` says, and replicate every other parameter and buffer over the mesh;
    returns `model`.

    `plan` maps module or parameter names, layer numbers written `*`, to Transformers' style names
    (`{"layers.*.self_attn.q_proj": "colwise", "layers.*.self_attn.o_proj": "rowwise", ...}`, e.g.
    `config.base_model_tp_plan` for the base model). The whole plan is checked against the model (every
    key names something, every split dim divides by the tp size) before any weight moves: a bad plan
    raises ValueError and leaves the model as it was. Parameters already on `tpu` keep their identity
    (an optimizer built before stays valid); CPU parameters are replaced by `tpu` ones, each chip
    receiving only its shard (so a model too big for one chip never sits whole on one). A parameter that is a
    tensor subclass over inner tensors (a torchao quantized weight) has those split as its own slicing splits
    them (`_inner_layouts`)."""
    if mesh is None:
        mesh = make_mesh(device_count(), "tp")
    tp_axis = _chosen_axis(mesh, tp_axis, "tp", "tp_axis")
    plan = _generic_plan(plan)
    _check_plan(model, plan)
    layouts = {}
    problems = []
    for name, param in model.named_parameters():
        key = _plan_entry(plan, name)
        dim = None if key is None else _split_dim(plan[key], param, is_bias=name.endswith("bias"))
        spec = () if dim is None else (None,) * dim + (tp_axis,)
        if param.device.type not in ("cpu", "tpu"):
            problems.append(f"{name} is on {param.device}: shard_model takes parameters on cpu or tpu")
        try:
            _check_spec(tuple(param.shape), mesh, spec)
            if is_traceable_wrapper_subclass(param):  # a quantized weight: its inner tensors' layouts
                spec = _inner_layouts(param, mesh, spec)
        except ValueError as e:
            problems.append(f"{name} ({plan[key]}): {e}")
        layouts[name] = spec
    if problems:
        raise ValueError("the plan does not fit this model on this mesh:\n  " + "\n  ".join(problems))
    moved = {}  # id of a CPU parameter -> its sharded replacement (tied parameters share one)
    for name, param in model.named_parameters():
        if is_traceable_wrapper_subclass(param):
            sharded = _shard_subclass(param, mesh, layouts[name])
            if sharded is not param:
                moved[id(param)] = torch.nn.Parameter(sharded, requires_grad=False)
            continue
        sharded = shard(param.data, mesh, layouts[name])
        if param.device.type == "tpu":
            param.data = sharded
        else:  # PyTorch cannot swap a CPU parameter's data for a tpu tensor in place
            moved[id(param)] = torch.nn.Parameter(sharded, requires_grad=param.requires_grad)
    _swap_in(model, moved, mesh)
    return model


def _fully_sharded_spec(param: torch.Tensor, mesh: Mesh, axis: str) -> tuple:
    """`param`'s layout with its first whole dim that `axis` divides split over `axis` as well, its other dims as
    they are (a weight split by `shard_model` over another axis keeps that split); unchanged where no dim divides."""
    layout = sharding(param)
    spec = (None,) * param.dim() if layout is None else layout.spec
    if layout is not None and layout.mesh != mesh:
        raise ValueError(f"a parameter of shape {tuple(param.shape)} is split over {layout.mesh}, not over the "
                         f"mesh {mesh} given to fully_shard")
    if any(axis == axes or (isinstance(axes, tuple) and axis in axes) for axes in spec):
        return spec
    parts = mesh.shape[axis]
    for dim, (size, axes) in enumerate(zip(param.shape, spec)):
        if axes is None and size % parts == 0:
            return spec[:dim] + (axis,) + spec[dim + 1:]
    return spec


def fully_shard(model: torch.nn.Module, mesh: Mesh | None = None, axis: str | None = None):
    """Split each of `model`'s parameters over the `axis` of `mesh` (default: a 1-D mesh "dp" over every chip),
    along its first dim that the axis divides, and replicate its buffers; returns `model`.

    This is fully sharded data parallelism (PyTorch's FSDP, DeepSpeed's ZeRO-3) as XLA's partitioner does it:
    with the batch split over the same axis (`shard(ids, mesh, ("dp", None))`), each program gathers a weight
    where it is used and leaves each gradient split as its weight, so the parameters, the gradients and the
    optimizer's state (made by the optimizer from the parameters, in their layout) take 1/N of their bytes on each
    of N chips, where data parallelism (`replicate`) holds them whole on every chip. No wrapper module and no hook:
    the same training step, eager or traced, runs over the mesh. A parameter no dim of which the axis divides
    stays whole on every chip (a bias of odd length); one split by `shard_model` over another axis of a 2-D mesh
    keeps that split and is split over `axis` along another dim. Quantized weights (tensor subclasses) are left
    as they are. Parameters on `tpu` keep their identity; CPU ones are replaced by `tpu` ones, each chip receiving
    only its part."""
    if mesh is None:
        mesh = make_mesh(device_count(), "dp")
    axis = _chosen_axis(mesh, axis, "dp", "axis")
    moved = {}  # id of a CPU parameter -> its sharded replacement (tied parameters share one)
    for param in model.parameters():
        if is_traceable_wrapper_subclass(param):
            continue
        sharded = shard(param.data, mesh, _fully_sharded_spec(param, mesh, axis))
        if param.device.type == "tpu":
            param.data = sharded
        else:  # PyTorch cannot swap a CPU parameter's data for a tpu tensor in place
            moved[id(param)] = torch.nn.Parameter(sharded, requires_grad=param.requires_grad)
    _swap_in(model, moved, mesh)
    return model
