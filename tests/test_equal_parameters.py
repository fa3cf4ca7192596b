"""Parameters created equal train as on the CPU, replicated over a mesh of 1, 2 or 8 chips, in every execution
mode and compiled, with AdamW's foreach step and its per-tensor one. Every norm layer's weight starts as ones
and its bias as zeros: the equal small values share one kept upload (`buffer.from_host`), and replicating
each over a mesh made arrays over that same chip memory, which an optimizer step then donated twice (XLA:
"Attempt to donate the same buffer twice", a SIGSEGV on several chips). The in-process tests use 1 and 2 of
the chips conftest simulates; the 8-chip ones run this file as a script."""

import subprocess
import sys

import pytest
import torch

import hf_tpu
import hf_tpu.distributed as dist
from hf_tpu.memory import buffer

MODES = ["DEFER_NEVER", "DEFER_AND_FUSE", "DEFER_NEVER_AND_LAUNCH_BLOCKING", "compiled"]
STEPS = 2
ROWS = 16  # splits over 1, 2 and 8 chips


def model_with_equal_parameters():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.LayerNorm(16), torch.nn.RMSNorm(16),
                               torch.nn.LayerNorm(16), torch.nn.Linear(16, 1))


def batch():
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(ROWS, 8, generator=generator)
    return x, x.sum(1, keepdim=True).sin()


def train(chips, mode, foreach):
    """(losses, parameters) after `STEPS` AdamW steps: on the CPU where `chips` is 0, else with the parameters
    replicated and the batch split over a mesh of `chips`."""
    model, (x, y) = model_with_equal_parameters(), batch()
    if chips:
        mesh = dist.mesh(chips, "dp")
        model.to("tpu")
        for p in model.parameters():
            p.data = dist.replicate(p.data, mesh)
        x, y = dist.shard(x, mesh, ("dp", None)), dist.shard(y, mesh, ("dp", None))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=foreach)

    def forward_backward(x, y):
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        return loss

    step = optimizer.step
    if mode == "compiled":
        forward_backward, step = torch.compile(forward_backward, backend="tpu"), torch.compile(step, backend="tpu")
    losses = []
    for _ in range(STEPS):
        losses.append(forward_backward(x, y).detach().cpu())
        step()
        optimizer.zero_grad()
    return torch.stack(losses), [p.detach().cpu() for p in model.parameters()]


def check(chips, mode, foreach):
    expected_losses, expected_parameters = train(0, mode, foreach)
    eager_mode = "DEFER_NEVER" if mode == "compiled" else mode
    with torch.tpu.use_eager_mode(eager_mode):
        losses, parameters = train(chips, mode, foreach)
        torch.tpu.synchronize()
    torch.testing.assert_close(losses, expected_losses, rtol=1e-5, atol=1e-6)
    for value, expected in zip(parameters, expected_parameters):
        torch.testing.assert_close(value, expected, rtol=1e-5, atol=1e-6)


# (chips, mode, foreach): every mode on 2 chips; both of AdamW's steps on 1, 2 and 8 (foreach, one program
# donated the same memory twice; per tensor, one step deleted the memory of a parameter the next step read)
CASES = [(2, mode, foreach) for mode in MODES[:3] for foreach in (False, True) if (mode, foreach) != (MODES[1], False)]
CASES += [(2, "compiled", True), (1, "DEFER_NEVER", False), (1, "DEFER_NEVER", True),
          (1, "DEFER_NEVER_AND_LAUNCH_BLOCKING", True)]
EIGHT_CHIP_CASES = [(8, "DEFER_NEVER", False), (8, "DEFER_NEVER", True)]


@pytest.mark.parametrize("chips, mode, foreach", [
    pytest.param(*case, marks=pytest.mark.requires_chips(case[0])) for case in CASES])
def test_equal_parameters_train_as_on_the_cpu(chips, mode, foreach):
    check(chips, mode, foreach)


def test_equal_parameters_train_as_on_the_cpu_over_eight_chips():
    from tests.util import cpu_process_env  # (not at the top: this file also runs as a script)

    env = cpu_process_env(HF_TPU_NUM_DEVICES="8")
    done = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    assert done.stdout.count("trains as on the CPU") == len(EIGHT_CHIP_CASES)


@pytest.mark.requires_chips(2)
def test_placements_share_no_chip_memory_with_their_source():
    """Every placement a tensor keeps (`dist.replicate` and `dist.shard` of a tpu tensor, `copy_` into a sharded
    tensor, `.to()` another chip of a replicated one) has memory of its own, apart from its source's and from
    the one kept upload that tensors made from equal values share: the allocator counts the holders of one
    jax.Array, never arrays over the same memory."""
    mesh = dist.mesh(2, "dp")
    a, b = torch.ones(16).to("tpu"), torch.ones(16).to("tpu")  # one kept upload
    replicas = [dist.replicate(t, mesh) for t in (a, b, a)]
    halves = dist.shard(a, mesh, ("dp",))
    made = [*replicas, halves, dist.replicate(halves, mesh), replicas[0].to("tpu:1"),
            dist.replicate(torch.zeros(16), mesh).copy_(b)]
    pointers = [{s.data.unsafe_buffer_pointer() for s in buffer.buffer_of(t).array.addressable_shards}
                for t in (a, *made)]
    assert all(p.isdisjoint(q) for i, p in enumerate(pointers) for q in pointers[i + 1:]), pointers
    assert all(torch.equal(t.cpu(), torch.ones(16)) for t in made)


@pytest.mark.requires_chips(2)
@pytest.mark.parametrize("compiler", ["torch.compile", "hf_tpu.jit"])
def test_a_program_writes_equal_replicated_tensors_in_place(compiler):
    """A compiled program donates the arrays it overwrites: two equal tensors replicated over a mesh each
    have their own."""
    mesh = dist.mesh(2, "dp")
    a, b = (dist.replicate(torch.ones(16).to("tpu"), mesh) for _ in range(2))

    def scale(a, b):
        a.mul_(2)
        b.mul_(3)

    scale = torch.compile(scale, backend="tpu") if compiler == "torch.compile" else hf_tpu.jit(scale)
    for _ in range(2):
        scale(a, b)
    assert torch.equal(a.cpu(), torch.full((16,), 4.0)) and torch.equal(b.cpu(), torch.full((16,), 9.0))


if __name__ == "__main__":
    assert torch.tpu.device_count() == 8, "run with HF_TPU_NUM_DEVICES=8"
    for case in EIGHT_CHIP_CASES:
        check(*case)
        print(f"{case}: trains as on the CPU", flush=True)
