"""`hf_tpu.scan_layers`: identical layers inside `hf_tpu.jit`'s trace run as one XLA loop (forward) and one reverse
loop (backward) with the unrolled loop's results; whatever a loop body cannot hold runs the layers one by one."""

import functools

import pytest
import torch
from torch.utils.checkpoint import checkpoint

import hf_tpu
from hf_tpu import direct


class Block(torch.nn.Module):
    def __init__(self, index, inner_checkpoint=None, dropout=0.0):
        super().__init__()
        self.index = index
        self.a = torch.nn.Linear(8, 16)
        self.b = torch.nn.Linear(16, 8)
        self.inner_checkpoint = inner_checkpoint  # None, or use_reentrant of a checkpoint around the MLP
        self.dropout = torch.nn.Dropout(dropout)
        # made by each layer for itself, as Transformers' activations are: alike, not the same object
        self.act = functools.partial(torch.nn.functional.gelu, approximate="tanh")

    def mlp(self, h):
        return self.b(self.dropout(self.act(self.a(h))))

    def forward(self, h, scale=None):
        if self.inner_checkpoint is None:
            return h + self.mlp(h) * scale
        return h + checkpoint(self.mlp, h, use_reentrant=self.inner_checkpoint) * scale


def _blocks(n=3, **options):
    torch.manual_seed(0)
    return torch.nn.ModuleList([Block(k, **options) for k in range(n)]).to("tpu")


def _step(layers, scanned, differing=("index",), autocast=False):
    def step(x, scale):
        h = x.clone().requires_grad_()
        with torch.autocast("tpu", dtype=torch.bfloat16, enabled=autocast):
            if scanned:
                out = hf_tpu.scan_layers(layers, h, (), {"scale": scale}, differing=differing)
            else:
                out = h
                for layer in layers:
                    out = layer(out, scale=scale)
        (out.float() ** 2).sum().backward()
        return out.detach(), h.grad.detach()

    return step


def _run(layers, scanned, **options):
    """The traced step's output, input gradient and parameter gradients, and its program's StableHLO."""
    direct.reset()
    for p in layers.parameters():
        p.grad = None
    x, scale = torch.randn(4, 8, generator=torch.Generator().manual_seed(1)).to("tpu"), torch.tensor(0.5).to("tpu")
    jitted = hf_tpu.jit(_step(layers, scanned, **options))
    torch.manual_seed(3)
    out, x_grad = jitted(x, scale)
    grads = [p.grad.cpu() for p in layers.parameters() if p.requires_grad]
    return out.cpu(), x_grad.cpu(), grads, jitted.lower(x, scale).as_text()


def _loops(text):
    return text.count("stablehlo.while")


@pytest.mark.parametrize("inner_checkpoint", [None, False, True])
def test_scanned_layers_give_the_unrolled_loops_results_in_two_loops(inner_checkpoint):
    """The layers differ only in an attribute named `differing`: one forward loop, one backward loop, the unrolled
    program's output and gradients; a checkpoint inside a layer (either form) recomputes with the layer's own
    parameters, in the backward loop."""
    layers = _blocks(inner_checkpoint=inner_checkpoint)
    unrolled = _run(layers, scanned=False)
    scanned = _run(layers, scanned=True)
    assert _loops(scanned[3]) == _loops(unrolled[3]) + 2
    for a, b in zip(scanned[:2] + tuple(scanned[2]), unrolled[:2] + tuple(unrolled[2])):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


def test_the_backward_loop_recomputes_under_the_forwards_autocast():
    """Under `torch.autocast` the forward's products are bfloat16; the backward, run by `backward()` outside the
    autocast, recomputes each layer with the same products, as the unrolled layers' saved values are: the gradients
    are the unrolled step's."""
    layers = _blocks()
    unrolled = _run(layers, scanned=False, autocast=True)
    scanned = _run(layers, scanned=True, autocast=True)
    for a, b in zip(scanned[:2] + tuple(scanned[2]), unrolled[:2] + tuple(unrolled[2])):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_the_loops_stacks_are_allocated_for_a_tpu_not_filled_with_zeros():
    """Each layer writes its own slice of the forward's stack of layer inputs and of the backward's stacked
    gradients, so the program lowered for a TPU allocates those stacks uninitialized (XLA's `AllocateBuffer`)
    instead of filling them with zeros first, which the v5e's XLA keeps before the backward's reverse loop."""
    layers = _blocks()
    direct.reset()
    x, scale = torch.randn(4, 8).to("tpu"), torch.tensor(0.5).to("tpu")
    text = direct.lower(_step(layers, scanned=True), (x, scale), {}, platform="tpu").as_text()
    # the layer inputs, and the gradients of `a` and `b`'s weights and biases
    assert text.count("custom_call @AllocateBuffer") == 5


def test_frozen_parameters_are_read_and_get_no_gradient():
    layers = _blocks()
    for layer in layers:
        layer.a.weight.requires_grad_(False)
    scanned = _run(layers, scanned=True)
    assert all(layer.a.weight.grad is None for layer in layers)
    unrolled = _run(layers, scanned=False)
    assert _loops(scanned[3]) == _loops(unrolled[3]) + 2
    for a, b in zip(scanned[2], unrolled[2]):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("case", ["an attribute differs", "random draws", "outside a trace", "hooks"])
def test_what_a_loop_cannot_hold_runs_the_layers_one_by_one(case, caplog):
    """Layers that differ (without `differing`), draw random numbers (each layer its own dropout masks), have hooks,
    or run outside a trace: the plain loop, with its results."""
    layers = _blocks(dropout=0.5 if case == "random draws" else 0.0)
    differing = () if case == "an attribute differs" else ("index",)
    calls = []
    if case == "hooks":
        layers[1].register_forward_hook(lambda *args: calls.append(1))
    if case == "outside a trace":
        x = torch.randn(4, 8).to("tpu")
        out = hf_tpu.scan_layers(layers, x, (), {"scale": 0.5}, differing=differing)
        expected = x
        for layer in layers:
            expected = layer(expected, scale=0.5)
        torch.testing.assert_close(out.cpu(), expected.cpu(), rtol=0, atol=0)
        return
    with caplog.at_level("INFO", logger="hf_tpu.layer_scan"):
        scanned = _run(layers, scanned=True, differing=differing)
    unrolled = _run(layers, scanned=False, differing=differing)
    assert _loops(scanned[3]) == _loops(unrolled[3])
    assert "run one by one" in caplog.text
    if case == "hooks":
        assert calls  # the hook ran: the layers were called as modules
    for a, b in zip(scanned[:2] + tuple(scanned[2]), unrolled[:2] + tuple(unrolled[2])):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


def test_a_layer_writing_a_callers_tensor_runs_unrolled_and_leaves_it_intact():
    """An in-place write to a tensor outside the layer would hold a tracer of the loop's body: the scan is given up
    before anything is kept, and the plain loop makes the write."""
    class Counting(torch.nn.Module):
        def __init__(self, seen):
            super().__init__()
            self.linear = torch.nn.Linear(8, 8)
            self.seen = seen

        def forward(self, h):
            self.seen.add_(1)
            return self.linear(h)

    torch.manual_seed(0)
    seen = torch.zeros(()).to("tpu")
    layers = torch.nn.ModuleList([Counting(seen) for _ in range(3)]).to("tpu")

    def step(x, seen):
        return hf_tpu.scan_layers(layers, x).detach()

    direct.reset()
    x = torch.randn(2, 8).to("tpu")
    out = hf_tpu.jit(step)(x, seen)
    expected = x
    for layer in layers:
        expected = layer.linear(expected)
    torch.testing.assert_close(out.cpu(), expected.detach().cpu())
    assert seen.item() == 3
