"""Python functions of hf-tpu that PyTorch calls, hidden from Dynamo's frame hook.

While a `torch.compile`d function runs, Dynamo's frame hook stays set, also in what runs eagerly: the code
after a graph break and the functions Dynamo skips (`torch.autograd.backward`). Every Python frame that starts
there is offered to Dynamo, which traces it as a function of its own unless its file is on Dynamo's skip list
(PyTorch's own Python is). PyTorch's factories and tensor methods are C builtins, with no frame; a Python
function hf-tpu puts in their place (`torch.ones_like`, which takes `pin_memory=True`) or calls from them (a
`tpu` kernel) is on no skip list. Dynamo would trace it, fail at the builtin it calls ("does not know how to
trace the builtin `torch._VariableFunctionsClass.ones_like`", printed as a UserWarning) and break the graph:
CPU code compiled after `import hf_tpu` would warn and compile otherwise than before. The functions named here
run as the builtins in their place do.

Code traced by Dynamo is not affected: a call it meets there is handled by what Dynamo knows of the callable
(a factory named `torch.ones_like` is an op of the graph), not by this hook.
"""

from __future__ import annotations


def hide_from_dynamo(*codes, recursive: bool = True) -> None:
    """Run the frames of `codes` (code objects) without offering them to Dynamo. `recursive`: the frames they
    start too (hf-tpu's own helpers); otherwise those are offered as usual (the frames a PyTorch builtin in
    whose place the code runs would start, such as a tensor subclass's `__torch_function__`)."""
    from torch._C._dynamo import eval_frame

    skip, default = eval_frame._FrameAction.SKIP, eval_frame._FrameAction.DEFAULT
    strategy = eval_frame._FrameExecStrategy(skip, skip if recursive else default)
    for code in codes:
        eval_frame.set_code_exec_strategy(code, strategy)
