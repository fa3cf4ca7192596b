"""The Pallas kernels (`hf_tpu.kernels`) against the XLA lowerings and references, in Pallas interpret mode
on the CPU (`HF_TPU_KERNELS=pallas`); which calls take a kernel and which fall back; users' kernels.

Interpret mode emulates the kernels slowly, so shapes are the smallest the kernels take (128 queries
and keys, head_dim 64). Tolerances: float32 kernels against float32 references at 2e-5 (the same
products summed in another order); bfloat16 results at 2e-2 (one or two roundings of the output).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import torch.nn.functional as F

import hf_tpu
from hf_tpu import kernels, platform
from hf_tpu.dispatch.program import PROGRAMS
from hf_tpu.kernels import flash_attention as flash
from hf_tpu.kernels import grouped_matmul
from hf_tpu.kernels import selection


@pytest.fixture
def kernel_mode(monkeypatch):
    """Set HF_TPU_KERNELS; programs traced under another choice are dropped first and after."""
    def use(mode):
        monkeypatch.setenv("HF_TPU_KERNELS", mode)
        PROGRAMS.clear()

    yield use
    PROGRAMS.clear()


@pytest.fixture
def kernel_calls(monkeypatch):
    """Counts the calls that reach each kernel entry point (at trace time)."""
    counts = {}

    def counting(module, name):
        original = getattr(module, name)

        def counted(*args, **kwargs):
            counts[name] = counts.get(name, 0) + 1
            return original(*args, **kwargs)

        monkeypatch.setattr(module, name, counted)

    for module, name in ((flash, "flash_attention"), (flash, "gradients"), (flash, "gradients_from_saved"),
                         (grouped_matmul, "gmm"),
                         (grouped_matmul, "tgmm")):
        counting(module, name)
    return counts


def _normal(seed, shape, dtype=jnp.float32):
    return jax.random.normal(jax.random.key(seed), shape, dtype)


# --- the attention kernel against its reference (JAX level)

ATTENTION_CASES = {
    # name: (heads, kv_heads, q_len, k_len, options, mask)
    "causal_aligned_to_last_keys_gqa": (4, 2, 128, 256, dict(is_causal=True, query_offset=128), None),
    "sliding_window_softcap": (2, 1, 256, 256, dict(is_causal=True, sliding_window=96, softcap=5.0), None),
    "no_mask": (1, 1, 128, 256, dict(), None),
    "padding_mask_with_hidden_rows": (1, 1, 128, 128, dict(is_causal=True), "left_padding"),
    # SDPA's form of the same: Transformers' (batch, 1, q, k) mask, causality in it, no pattern named
    "causal_and_padding_in_a_full_mask": (2, 1, 128, 128, dict(), "causal_and_padding"),
    "any_other_mask": (2, 1, 128, 128, dict(), "random"),
}


def _padding_mask(batch, k_len):
    """Left padding, (batch, 1, 1, k_len): the second sequence's first 40 keys are padding, so with a
    causal pattern its first 40 queries see nothing."""
    starts = jnp.array([0, 40])[:batch]
    return (jnp.arange(k_len)[None, :] >= starts[:, None])[:, None, None, :]


def _mask(kind, batch, q_len, k_len):
    if kind == "left_padding":
        return _padding_mask(batch, k_len)
    if kind == "causal_and_padding":
        return _padding_mask(batch, k_len) & jnp.tril(jnp.ones((q_len, k_len), jnp.bool_))
    return jax.random.bernoulli(jax.random.key(4), 0.7, (batch, 1, q_len, k_len))


# interpret mode takes 5-15 s a case here; the op-level tests below cover window and soft-cap too
SLOW_CASES = ("sliding_window_softcap", "no_mask")


@pytest.mark.parametrize("case", [pytest.param(c, marks=pytest.mark.slow) if c in SLOW_CASES else c
                                  for c in ATTENTION_CASES])
def test_flash_attention_kernel_matches_reference_forward_and_backward(case):
    heads, kv_heads, q_len, k_len, options, mask = ATTENTION_CASES[case]
    batch = 2 if mask else 1  # the padded batch: one sequence padded, one not
    q = _normal(0, (batch, heads, q_len, 64))
    k = _normal(1, (batch, kv_heads, k_len, 64))
    v = _normal(2, (batch, kv_heads, k_len, 64))
    mask = _mask(mask, batch, q_len, k_len) if mask else None
    options = dict(scale=0.125, **options)
    assert flash.unsupported(q, k, v, mask, is_causal=options.get("is_causal", False),
                             query_offset=options.get("query_offset", 0)) is None
    out, logsumexp = flash.flash_attention(q, k, v, mask, with_logsumexp=True, interpret=True, **options)
    want, want_logsumexp = flash.reference(q, k, v, mask, with_logsumexp=True, **options)
    np.testing.assert_allclose(out, want, atol=2e-5, rtol=2e-5)
    np.testing.assert_allclose(logsumexp, want_logsumexp, atol=2e-5, rtol=2e-5)
    if case == "padding_mask_with_hidden_rows":
        assert not np.asarray(out[1, :, :40]).any()  # fully hidden rows give 0, as the XLA lowerings do

    grad_out = _normal(3, q.shape)
    grads = flash.gradients(grad_out, q, k, v, mask, interpret=True, **options)
    _, pullback = jax.vjp(lambda q, k, v: flash.reference(q, k, v, mask, **options), q, k, v)
    for got, expected in zip(grads, pullback(grad_out)):
        np.testing.assert_allclose(got, expected, atol=5e-5, rtol=5e-5)
    if mask is None:  # the backward from the forward's output and logsumexp: the same kernels on the same values
        saved = flash.gradients_from_saved(grad_out, q, k, v, out, logsumexp, interpret=True, **options)
        for got, expected in zip(saved, grads):
            np.testing.assert_allclose(got, expected, atol=1e-6, rtol=1e-6)


def test_masks_are_matched_to_a_pattern_with_hidden_keys_or_left_to_the_dynamic_mask():
    causal = jnp.tril(jnp.ones((128, 128), jnp.bool_))
    padding = _padding_mask(2, 128)
    every_key = jnp.ones((2, 128), jnp.bool_)
    bare = flash.patterns_to_try(False, 0, 0)  # SDPA's causal, then full
    for mask, patterns, expected, keys in [
        (causal & padding, bare, 0, padding[:, 0, 0]),
        (jnp.broadcast_to(causal, (2, 1, 128, 128)), bare, 0, every_key),
        (jnp.broadcast_to(padding, (2, 1, 128, 128)), bare, 1, padding[:, 0, 0]),  # a padded encoder
        ((causal & padding).at[0, 0, 100, 3].set(False), bare, 2, None),  # one more hidden pair
        (jnp.broadcast_to(~causal | jnp.eye(128, dtype=jnp.bool_), (2, 1, 128, 128)), bare, 2, None),
        (padding & flash._positions_visible(128, 128, True, 96, 0), flash.patterns_to_try(True, 96, 0), 0,
         padding[:, 0, 0]),
    ]:
        chosen, keys_seen = flash.matching_pattern(mask, patterns)
        assert int(chosen) == expected
        if keys is not None:
            np.testing.assert_array_equal(keys_seen, keys)


def _kernels_and_their_loops(jaxpr, enclosing=()):
    """(grid, enclosing primitives) of each pallas_call in `jaxpr`; a cond's branch is named by its index."""
    from jax.extend.core import jaxprs_in_params

    found = []
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        if name == "pallas_call":
            found.append((eqn.params["grid_mapping"].grid, enclosing))
        elif name == "cond":
            for index, branch in enumerate(eqn.params["branches"]):
                found += _kernels_and_their_loops(branch.jaxpr, enclosing + (f"cond branch {index}",))
        else:
            for inner in jaxprs_in_params(eqn.params):
                found += _kernels_and_their_loops(inner, enclosing + (name,))
    return found


@pytest.mark.parametrize("mask_shape, options", [((8, 1, 256, 256), {}), ((8, 1, 256, 256), dict(is_causal=True)),
                                                 ((8, 1, 1, 256), dict(is_causal=True)), ((8, 1, 1, 256), {})])
def test_a_batch_under_a_models_mask_is_one_kernel_call_on_the_tpu(mask_shape, options):
    """The TPU (non-interpret) path, traced on the CPU: a mask of the models' form runs one kernel whose
    grid holds the batch; only the fallback for other masks loops over the batch elements."""
    query = jax.ShapeDtypeStruct((8, 4, 256, 64), jnp.bfloat16)
    key = jax.ShapeDtypeStruct((8, 2, 256, 64), jnp.bfloat16)
    mask = jax.ShapeDtypeStruct(mask_shape, jnp.bool_)
    with jax.enable_x64(False):
        traced = jax.make_jaxpr(lambda q, k, v, m: flash.flash_attention(
            q, k, v, m, scale=0.125, with_logsumexp=True, interpret=False, **options))(query, key, key, mask)
    kernels = _kernels_and_their_loops(traced.jaxpr)
    patterns = 0 if mask_shape[2] == 1 else len(flash.patterns_to_try(options.get("is_causal", False), 0, 0))
    fallback = f"cond branch {patterns}"
    one_call = [grid for grid, enclosing in kernels if fallback not in enclosing]
    assert one_call and all(grid[0] == 8 for grid in one_call)  # the batch is the grid's first axis
    assert all({"scan", "while"}.isdisjoint(enclosing) for grid, enclosing in kernels if fallback not in enclosing)
    if patterns:  # the fallback: one call per batch element
        assert all("scan" in enclosing for grid, enclosing in kernels if fallback in enclosing)


@pytest.mark.parametrize("reason, call", [
    ("multiples of 128", lambda: flash.unsupported(*_qkv(1, 256), None)),  # a decode step
    ("multiples of 128", lambda: flash.unsupported(*_qkv(100, 100), None)),
    ("bfloat16, float32", lambda: flash.unsupported(*_qkv(128, 128, jnp.float16), None)),
    ("boolean masks", lambda: flash.unsupported(*_qkv(128, 128), jnp.zeros((1, 1, 128, 128), jnp.float32))),
    ("multiples of 64", lambda: flash.unsupported(*_qkv(128, 128, head_dim=32), None)),
    ("hidden rows", lambda: flash.unsupported(*_qkv(256, 128), None, is_causal=True, query_offset=-128)),
])
def test_attention_kernel_declines_what_it_cannot_take(reason, call):
    assert reason in call()


def _qkv(q_len, k_len, dtype=jnp.float32, head_dim=64):
    return (jax.ShapeDtypeStruct((1, 4, q_len, head_dim), dtype), jax.ShapeDtypeStruct((1, 2, k_len, head_dim), dtype),
            jax.ShapeDtypeStruct((1, 2, k_len, head_dim), dtype))


def test_block_sizes_are_the_largest_lane_multiples_that_divide(monkeypatch):
    sizes = flash.block_sizes(384, 1024)
    assert (sizes.block_q, sizes.block_kv, sizes.block_q_dq, sizes.block_kv_dkv) == (384, 512, 384, 512)
    monkeypatch.setenv("HF_TPU_KERNEL_BLOCK", "256")
    assert flash.block_sizes(1024, 640).block_kv == 128
    monkeypatch.setenv("HF_TPU_KERNEL_BLOCK", "200")
    with pytest.raises(ValueError, match="multiple of 128"):
        flash.block_sizes(1024, 1024)


# --- the attention ops on tpu: kernel against XLA lowering


def _torch_qkv(heads, kv_heads, q_len, k_len, dtype=torch.bfloat16, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(2, h, n, 64, generator=generator, dtype=dtype)
            for h, n in ((heads, q_len), (kv_heads, k_len), (kv_heads, k_len))]


def _run_both(kernel_mode, fn):
    """fn() under the XLA lowering and under the kernel, results on the CPU."""
    kernel_mode("xla")
    xla = fn()
    kernel_mode("pallas")
    return xla, fn()


def _forward_and_grads(op, tensors, **kwargs):
    leaves = [t.to("tpu").requires_grad_() for t in tensors]
    out = op(*leaves, **kwargs)
    out.float().square().sum().backward()
    return [out.detach().cpu().float()] + [leaf.grad.cpu().float() for leaf in leaves]


def test_hf_tpu_flash_attention_takes_the_kernel_forward_and_backward(kernel_mode, kernel_calls):
    q, k, v = _torch_qkv(4, 2, 128, 256)
    mask = torch.ones(2, 1, 128, 256, dtype=torch.bool)
    mask[1, ..., :60] = False  # padding

    def run():
        return _forward_and_grads(lambda q, k, v: torch.ops.hf_tpu.flash_attention(
            q, k, v, mask.to("tpu"), None, True, 100, 30.0), (q, k, v))

    xla, pallas = _run_both(kernel_mode, run)
    assert kernel_calls == {"flash_attention": 2, "gradients": 1}  # the forward, and the one the gradient runs
    for got, want in zip(pallas, xla):
        torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)


def test_hf_tpu_flash_attention_backward_reads_the_forwards_logsumexp(kernel_mode, kernel_calls):
    """Without a mask the backward's kernels take the forward's output and logsumexp: the attention's forward runs
    once (a checkpointed layer's recomputation aside), not again inside the backward."""
    q, k, v = _torch_qkv(4, 2, 128, 128)

    def run():
        return _forward_and_grads(lambda q, k, v: torch.ops.hf_tpu.flash_attention(q, k, v, None, None, True),
                                  (q, k, v))

    xla, pallas = _run_both(kernel_mode, run)
    assert kernel_calls == {"flash_attention": 1, "gradients_from_saved": 1}
    for got, want in zip(pallas, xla):
        torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)


def test_sdpa_fused_op_takes_the_kernel_with_top_left_causal_alignment(kernel_mode, kernel_calls):
    q, k, v = _torch_qkv(2, 2, 128, 256)  # more keys than queries: SDPA's causal mask is top-left

    def run():
        return _forward_and_grads(F.scaled_dot_product_attention, (q, k, v), is_causal=True)

    xla, pallas = _run_both(kernel_mode, run)
    assert kernel_calls == {"flash_attention": 2, "gradients": 1}  # the forward, and the one the gradient runs
    for got, want in zip(pallas, xla):
        torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)
    cpu = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=True)
    torch.testing.assert_close(pallas[0], cpu, atol=2e-2, rtol=2e-2)


def test_sdpa_with_a_boolean_mask_takes_the_kernel(kernel_mode, kernel_calls):
    q, k, v = _torch_qkv(2, 2, 128, 128, dtype=torch.bfloat16, seed=1)
    mask = torch.rand(128, 128, generator=torch.Generator().manual_seed(2)) > 0.3
    xla, pallas = _run_both(kernel_mode, lambda: F.scaled_dot_product_attention(
        q.to("tpu"), k.to("tpu"), v.to("tpu"), attn_mask=mask.to("tpu")).cpu().float())
    assert kernel_calls == {"flash_attention": 1}
    torch.testing.assert_close(pallas, xla, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("case", ["decode", "float16", "additive_mask", "highest_float32"])
def test_calls_outside_the_kernel_rules_keep_the_xla_lowering(case, kernel_mode, kernel_calls):
    kernel_mode("pallas")
    dtype = {"float16": torch.float16, "highest_float32": torch.float32}.get(case, torch.bfloat16)
    q, k, v = (t.to("tpu") for t in _torch_qkv(4, 2, 1 if case == "decode" else 128, 128, dtype=dtype))
    mask = torch.zeros(2, 1, q.shape[2], 128, dtype=dtype, device="tpu") if case == "additive_mask" else None
    torch.ops.hf_tpu.flash_attention(q, k, v, mask, None, case != "decode").cpu()
    assert kernel_calls == {}


def test_auto_takes_kernels_on_a_tpu_only_and_xla_never(monkeypatch):
    for mode, on_tpu, on_cpu in (("auto", True, False), ("xla", False, False), ("pallas", True, True)):
        monkeypatch.setenv("HF_TPU_KERNELS", mode)
        monkeypatch.setattr(platform, "name", lambda: "tpu")
        assert selection.pallas_enabled() is on_tpu and not selection.interpret()
        monkeypatch.setattr(platform, "name", lambda: "cpu")
        assert selection.pallas_enabled() is on_cpu and selection.interpret()
    monkeypatch.setenv("HF_TPU_KERNELS", "mosaic")
    with pytest.raises(ValueError, match="HF_TPU_KERNELS"):
        selection.mode()


# --- the grouped matmul kernels


def test_gmm_and_tgmm_kernels_match_their_references():
    sizes = jnp.array([50, 0, 100, 80], jnp.int32)  # an empty group; rows 230.. are past the groups
    x, w = _normal(0, (256, 128)), _normal(1, (4, 128, 256))
    np.testing.assert_allclose(grouped_matmul.gmm(x, w, sizes, interpret=True),
                               grouped_matmul.reference_gmm(x, w, sizes), atol=2e-4, rtol=2e-5)
    xt, y = _normal(2, (128, 200)), _normal(3, (200, 128))  # 200 rows: padded to whole row tiles
    sizes = jnp.array([50, 0, 100, 40], jnp.int32)
    np.testing.assert_allclose(grouped_matmul.tgmm(xt, y, sizes, interpret=True),
                               grouped_matmul.reference_tgmm(xt, y, sizes), atol=2e-4, rtol=2e-5)
    assert "multiples of 128" in grouped_matmul.unsupported(_normal(0, (8, 96)), _normal(1, (2, 96, 128)))


def test_grouped_mm_takes_megablox_forward_and_backward(kernel_mode, kernel_calls):
    generator = torch.Generator().manual_seed(0)
    a = torch.randn(64, 128, generator=generator).to(torch.bfloat16)
    b = torch.randn(4, 128, 128, generator=generator).to(torch.bfloat16)
    offs = torch.tensor([10, 10, 40, 60], dtype=torch.int32)
    grad = torch.randn(64, 128, generator=generator).to(torch.bfloat16)
    grad[60:] = 0

    def run():
        leaves = [a.to("tpu").requires_grad_(), b.to("tpu").requires_grad_()]
        out = torch._grouped_mm(*leaves, offs=offs.to("tpu"))
        out.backward(grad.to("tpu"))
        return [out.detach().cpu().float()] + [leaf.grad.cpu().float() for leaf in leaves]

    xla, pallas = _run_both(kernel_mode, run)
    assert set(kernel_calls) == {"gmm", "tgmm"}  # forward and input gradient, weight gradient
    for got, want in zip(pallas, xla):
        torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)
    assert not pallas[0][60:].any()


# --- users' kernels


def _scale_by_two_kernel(x):
    """A Pallas kernel: x * 2, one block."""
    from jax.experimental import pallas as pl

    def body(x_ref, o_ref):
        o_ref[...] = x_ref[...] * 2

    return pl.pallas_call(body, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype), interpret=kernels.interpret())(x)


def test_a_registered_kernel_replaces_the_lowering_where_it_applies(kernel_mode):
    x = torch.arange(8.0)
    kernel_mode("auto")  # on the CPU: a kernel for ("tpu",) stays off, one for ("cpu",) runs
    registration = kernels.register(torch.ops.aten.exp2.default, _scale_by_two_kernel, platforms=("tpu",))
    try:
        torch.testing.assert_close(torch.exp2(x.to("tpu")).cpu(), torch.exp2(x))
        on_cpu = kernels.register(torch.ops.aten.exp2, _scale_by_two_kernel, platforms="cpu",
                                  applies=lambda self: self.shape[0] == 8)
        assert kernels.registered(torch.ops.aten.exp2.default) == [on_cpu, registration]
        torch.testing.assert_close(torch.exp2(x.to("tpu")).cpu(), x * 2)
        torch.testing.assert_close(torch.exp2(torch.arange(4.0, device="tpu")).cpu(), torch.exp2(torch.arange(4.0)))
        kernel_mode("xla")
        torch.testing.assert_close(torch.exp2(x.to("tpu")).cpu(), torch.exp2(x))
        kernel_mode("auto")
        on_cpu.remove()
        torch.testing.assert_close(torch.exp2(x.to("tpu")).cpu(), torch.exp2(x))
    finally:
        registration.remove()
    assert kernels.registered(torch.ops.aten.exp2.default) == []


@torch.library.custom_op("hf_tpu_tests::double", mutates_args=(), device_types="cpu")
def _double(x: torch.Tensor) -> torch.Tensor:
    return x * 2


def test_a_custom_op_gets_a_kernel_on_tpu_and_its_reference_elsewhere(kernel_mode):
    with pytest.raises(ValueError, match="reference="):
        kernels.register(torch.ops.hf_tpu_tests.double, _scale_by_two_kernel)
    kernel_calls = []

    def kernel(x):
        kernel_calls.append(1)
        return _scale_by_two_kernel(x)

    registration = kernels.register(torch.ops.hf_tpu_tests.double, kernel, reference=lambda x: x * 2)
    try:
        kernel_mode("auto")  # the CPU platform: the reference
        torch.testing.assert_close(_double(torch.arange(4.0, device="tpu")).cpu(), torch.arange(4.0) * 2)
        assert not kernel_calls
        kernel_mode("pallas")  # the kernel, interpreted
        torch.testing.assert_close(_double(torch.arange(4.0, device="tpu")).cpu(), torch.arange(4.0) * 2)
        assert kernel_calls
    finally:
        registration.remove()


def test_register_names_its_errors():
    with pytest.raises(ValueError, match="no op is named"):
        kernels.register("rms_norm", _scale_by_two_kernel)
    assert kernels.NAMED_OPS["flash_attention"]() is torch.ops.hf_tpu.flash_attention.default


@pytest.mark.slow  # a process of its own: 10-20 s
def test_the_example_runs_a_user_pallas_kernel_in_interpret_mode():
    result = subprocess.run([sys.executable, "examples/pallas_kernel.py"], capture_output=True, text=True, timeout=300,
                            env={**os.environ, "HF_TPU_PLATFORM": "cpu"})
    assert result.returncode == 0, result.stderr[-2000:]
    assert "the kernel ran: True" in result.stdout and "matches the reference" in result.stdout


@pytest.mark.slow  # a process of its own, every case compiled: 15-45 s
def test_the_chip_benchmark_runs_its_tiny_form(tmp_path):
    result = subprocess.run([sys.executable, "-m", "benchmarks.kernels_on_chip", "--tiny", "--iters", "1",
                             "--json", str(tmp_path / "rows.json")], capture_output=True, text=True, timeout=300,
                            env={**os.environ, "HF_TPU_PLATFORM": "cpu"})
    assert result.returncode == 0, result.stderr[-2000:]
    rows = json.loads((tmp_path / "rows.json").read_text())["rows"]
    assert {r["kernel"] for r in rows} == {"attention", "decode attention", "grouped matmul"}
    attention = [r for r in rows if r["kernel"] == "attention"]
    assert all(r["pallas"] and r["pallas_keys"] and r["xla_scan"] and r["xla_full"] for r in attention), \
        result.stderr[-2000:]
    assert all(r["megablox"] and r["ragged"] for r in rows if r["kernel"] == "grouped matmul"), result.stderr[-2000:]
    assert "full/pallas" in result.stdout


@pytest.mark.slow  # a process of its own: about 10 s
def test_the_rotary_layouts_benchmark_runs_its_tiny_form(tmp_path):
    """Every form of the rotary embeddings computes the values hf_tpu's reads give, bit for bit."""
    result = subprocess.run([sys.executable, "-m", "benchmarks.rotary_layouts", "--iters", "1", "--layers", "1",
                             "--json", str(tmp_path / "rows.json")], capture_output=True, text=True, timeout=300,
                            env={**os.environ, "HF_TPU_PLATFORM": "cpu"})
    assert result.returncode == 0, result.stderr[-2000:]
    rows = {r["form"]: r for r in json.loads((tmp_path / "rows.json").read_text())["rows"]}
    assert list(rows) == ["hf_tpu", "each_slice_transposed", "transposed_unkept", "rotated_then_transposed",
                          "bfloat16_ops", "none"]
    assert all(rows[form]["max_diff"] == 0 for form in list(rows)[:-1]) and rows["none"]["max_diff"] > 0, rows
    assert "vs hf_tpu" in result.stdout


@pytest.mark.slow  # two processes of their own: about 25 s
def test_the_linear_layouts_benchmark_runs_its_tiny_form(tmp_path):
    """Both float32 forms of the linear layers compute the same logits, bit for bit, at each shape asked for; the
    bfloat16 product's rounding is XLA's to choose."""
    result = subprocess.run([sys.executable, "-m", "benchmarks.linear_layouts", "--iters", "1", "--layers", "1",
                             "--shapes", "1x128,2x128", "--json", str(tmp_path / "rows.json")], capture_output=True,
                            text=True, timeout=300, env={**os.environ, "HF_TPU_PLATFORM": "cpu"})
    assert result.returncode == 0, result.stderr[-2000:]
    shapes = json.loads((tmp_path / "rows.json").read_text())["shapes"]
    assert [s["shape"] for s in shapes] == [[1, 128], [2, 128]]
    for shape in shapes:
        rows = {r["form"]: r for r in shape["rows"]}
        assert list(rows) == ["flattened", "in_shape", "bfloat16_product"]
        assert rows["in_shape"]["max_diff"] == 0 and rows["bfloat16_product"]["max_diff"] < 0.05, rows
    assert "at 1x128" in result.stdout and "at 2x128" in result.stdout and "vs flattened" in result.stdout
    bad = subprocess.run([sys.executable, "-m", "benchmarks.linear_layouts", "--shapes", "8by1024"],
                         capture_output=True, text=True, timeout=120, env={**os.environ, "HF_TPU_PLATFORM": "cpu"})
    assert bad.returncode == 2 and "expected shapes such as 8x1024" in bad.stderr


@pytest.mark.slow  # a process of its own: about 10 s
def test_the_attention_compile_benchmark_runs_its_tiny_form(tmp_path):
    result = subprocess.run([sys.executable, "-m", "benchmarks.attention_compile", "--json",
                             str(tmp_path / "rows.json")], capture_output=True, text=True, timeout=300,
                            env={**os.environ, "HF_TPU_PLATFORM": "cpu"})
    assert result.returncode == 0, result.stderr[-2000:]
    rows = json.loads((tmp_path / "rows.json").read_text())
    assert set(rows) == {f"b{b} {name} x{n}" for b in (1, 8) for name in ("kernel", "xla") for n in (1, 16)}
    assert all(row["compile"] > 0 and row["ms"] > 0 for row in rows.values())


@pytest.mark.slow  # a process of its own: about 12 s
def test_the_attention_layouts_benchmark_computes_attention_in_every_layout(tmp_path):
    """Each layout's kernel and splash, interpreted at tiny shapes, within a bfloat16 rounding (outputs up
    to about 4: 0.0156 a unit in the last place) of the float32 reference."""
    from benchmarks import attention_layouts

    result = subprocess.run([sys.executable, "-m", "benchmarks.attention_layouts", "--json",
                             str(tmp_path / "rows.json")], capture_output=True, text=True, timeout=300,
                            env={**os.environ, "HF_TPU_PLATFORM": "cpu"})
    assert result.returncode == 0, result.stderr[-2000:]
    rows = json.loads((tmp_path / "rows.json").read_text())
    assert [r["form"] for r in rows] == ["splash 128/128/128", *attention_layouts.LAYOUTS]
    assert all(r["ms"] > 0 and r["largest_difference"] <= 0.0157 for r in rows), rows
