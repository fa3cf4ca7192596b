"""A first look at the `tpu` device: tensors, views, a module's forward and backward, against CPU.

Run: python examples/tensors_and_modules.py
"""

import torch

import hf_tpu


def main():
    x = torch.arange(12.0).reshape(3, 4)
    t = x.to("tpu")
    t[:, ::2].mul_(10)  # a strided in-place write reaches the base
    x[:, ::2].mul_(10)
    assert torch.equal(t.cpu(), x)

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.SiLU(), torch.nn.Linear(16, 1))
    expected = model(x).sum()
    expected.backward()
    cpu_grad = model[0].weight.grad.clone()
    model.zero_grad()

    model.to("tpu")
    actual = model(t).sum()
    actual.backward()
    print(f"loss cpu {expected.item():.5f}  tpu {actual.item():.5f}")
    print(f"max grad difference {(model[0].weight.grad.cpu() - cpu_grad).abs().max().item():.2e}")
    print(hf_tpu.metrics())


if __name__ == "__main__":
    main()
