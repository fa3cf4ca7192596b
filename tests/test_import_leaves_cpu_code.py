"""`import hf_tpu` leaves CPU code compiled with `torch.compile` as it was: the functions hf-tpu puts in place of
PyTorch's (the factories that take `pin_memory`, `Tensor.new_*`, `is_pinned`, `torch.Generator`,
`UntypedStorage.__new__`, `Module.to`) run under Dynamo's frame hook as the builtins and methods they replace do.
Before, each one reached from code that runs eagerly under the hook (after a graph break, or inside
`torch.autograd.backward`, which Dynamo skips) was traced by Dynamo as a function of its own, which printed a
UserWarning ("Dynamo does not know how to trace the builtin `torch._VariableFunctionsClass.ones_like`") and
broke the graph.

The same program runs in two processes, one that imports hf_tpu and one that does not: results, warnings,
graphs and graph breaks must be the same."""

import json
import subprocess
import sys

from tests.util import cpu_process_env

PROGRAM = r"""
import json, sys, warnings
if sys.argv[1] == "with":
    import hf_tpu
import torch
import torch._dynamo
from torch._dynamo.utils import counters


@torch._dynamo.disable(recursive=False)  # runs eagerly under Dynamo's hook, as torch.autograd.backward does
def eagerly(x):
    generator = torch.Generator().manual_seed(0)
    layer = torch.nn.Linear(3, 3).to("cpu").cpu().to(torch.float32)
    return (torch.zeros(3) + torch.ones_like(x) + torch.full((3,), 2.0) + torch.arange(3) + x.new_ones(3)
            + torch.randn(3, generator=generator) + float(x.is_pinned()) + torch.UntypedStorage(8).nbytes()
            + layer.weight.sum() * 0)


def step(x, w):
    (w * w).sum().backward()  # backward's torch.ones_like runs eagerly
    return eagerly(x) + torch.zeros_like(x) + torch.full((3,), 1.0) + x.new_zeros(3) + float(x.is_pinned()), w.grad


torch.manual_seed(0)
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    y, grad = torch.compile(step, backend="eager")(torch.arange(3.0), torch.arange(3.0, requires_grad=True))
print(json.dumps({"results": [y.tolist(), grad.tolist()], "warnings": [str(w.message)[:200] for w in caught],
                  "graphs": counters["stats"]["unique_graphs"], "graph breaks": sum(counters["graph_break"].values())}))
"""


def test_cpu_code_compiles_and_runs_as_without_hf_tpu():
    processes = {which: subprocess.Popen([sys.executable, "-c", PROGRAM, which], stdout=subprocess.PIPE,
                                         stderr=subprocess.PIPE, text=True, env=cpu_process_env())
                 for which in ("with", "without")}
    reports = {}
    for which, process in processes.items():
        out, err = process.communicate(timeout=300)
        assert process.returncode == 0, err[-3000:]
        reports[which] = json.loads(out.strip().splitlines()[-1])
    assert reports["with"]["warnings"] == []
    assert reports["with"] == reports["without"]
