"""Sharding across chips (hf_tpu.distributed): sharded tensors give the values of unsharded ones in
every execution mode, memory is counted per chip, and `shard_model` with Transformers' plans gives
the unsharded model's outputs and training step. The in-process tests use the two chips conftest
simulates; the 1/2/4/8-chip and 2 x 4 checks run this file as a script with 8 simulated chips."""

import copy
import gc
import logging
import os
import subprocess
import sys

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import hf_tpu
import hf_tpu.distributed as dist

MODES = ["DEFER_NEVER", "DEFER_AND_FUSE", "DEFER_NEVER_AND_LAUNCH_BLOCKING"]
CONFIG = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                     num_attention_heads=8, num_key_value_heads=8, max_position_embeddings=64)


def chip_memory():
    return [torch.tpu.memory_allocated(i) for i in range(torch.tpu.device_count())]


def test_mesh_layout_and_errors():
    mesh = dist.mesh(2, "tp")
    assert mesh.shape == {"tp": 2} and mesh.device == torch.device("tpu", 0)
    assert mesh.device_indices.tolist() == [0, 1]
    with pytest.raises(ValueError, match="needs 4 chips but this process has 2"):
        dist.mesh((2, 2), ("dp", "tp"))
    with pytest.raises(ValueError, match="axis names"):
        dist.mesh((1, 2), ("tp",))
    with pytest.raises(ValueError, match="does not split evenly"):
        dist.shard(torch.zeros(3, 4), mesh, ("tp",))
    with pytest.raises(ValueError, match="does not have"):
        dist.shard(torch.zeros(4, 4), mesh, ("dp",))


def test_shard_replicate_memory_and_gather():
    mesh = dist.mesh(2, "tp")
    gc.collect()
    before = chip_memory()
    host = torch.randn(6, 8)
    split = dist.shard(host, mesh, (None, "tp"))
    assert split.device == torch.device("tpu", 0)
    assert dist.sharding(split) == dist.Sharding(mesh, (None, "tp"))
    assert [now - then for now, then in zip(chip_memory(), before)] == [6 * 4 * 4, 6 * 4 * 4]
    whole = dist.replicate(split, mesh)
    assert dist.sharding(whole) == dist.Sharding(mesh, (None, None))
    assert [now - then for now, then in zip(chip_memory(), before)] == [6 * 4 * 4 + 6 * 8 * 4] * 2
    assert dist.sharding(host.to("tpu")) is None
    assert torch.equal(split.cpu(), host) and torch.equal(whole.cpu(), host)
    del split, whole
    gc.collect()
    assert chip_memory() == before


@pytest.mark.parametrize("mode", MODES)
def test_results_of_sharded_ops_count_per_chip(mode):
    mesh = dist.mesh(2, "tp")
    split = dist.shard(torch.randn(8, 6), mesh, ("tp",))
    gc.collect()
    before = chip_memory()
    with torch.tpu.use_eager_mode(mode):
        doubled = split * 2
        torch.tpu.synchronize()
    assert dist.sharding(doubled) == dist.Sharding(mesh, ("tp", None))
    assert [now - then for now, then in zip(chip_memory(), before)] == [4 * 6 * 4, 4 * 6 * 4]


@pytest.mark.parametrize("mode", MODES)
def test_ops_on_sharded_tensors_match_cpu(mode):
    mesh = dist.mesh(2, "tp")
    torch.manual_seed(0)
    x, w, bias = torch.randn(4, 6), torch.randn(6, 8), torch.randn(8)

    def compute(x, w, bias):
        y = torch.softmax(x @ w + bias, dim=-1)
        z = y.clone()
        z[:, 1:5].mul_(3)  # an in-place write through a view of a sharded buffer
        z.t()[::2].add_(1)
        return y.sum(0), z, torch.cat([y, z], 0).amax(1), z[1:, ::3], z.view(2, 16).mean(0)

    with torch.tpu.use_eager_mode(mode):
        results = compute(dist.shard(x, mesh, ("tp",)), dist.shard(w, mesh, (None, "tp")), bias.to("tpu"))
        results = [r.cpu() for r in results]
    for actual, expected in zip(results, compute(x, w, bias)):
        torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5)


def test_gradients_through_sharded_weights():
    mesh = dist.mesh(2, "tp")
    torch.manual_seed(0)
    x, w = torch.randn(4, 6), torch.randn(6, 8, requires_grad=True)
    sharded = dist.shard(w.detach(), mesh, (None, "tp")).requires_grad_()
    (dist.shard(x, mesh, ("tp",)) @ sharded).tanh().sum().backward()
    (x @ w).tanh().sum().backward()
    assert dist.sharding(sharded.grad) is not None
    torch.testing.assert_close(sharded.grad.cpu(), w.grad, rtol=1e-5, atol=1e-5)


def tiny_llama():
    """The same weights on every call."""
    torch.manual_seed(0)
    return LlamaForCausalLM(CONFIG).eval()


@pytest.mark.parametrize("mode", ["DEFER_NEVER", "DEFER_AND_FUSE"])
def test_shard_model_matches_unsharded(mode):
    model = tiny_llama()
    ids = torch.randint(0, CONFIG.vocab_size, (2, 10))
    with torch.no_grad():
        expected = model(ids).logits
    gc.collect()
    before = chip_memory()
    dist.shard_model(model, model.tp_plan, dist.mesh(2, "tp"))
    down = model.model.layers[0].mlp.down_proj.weight
    assert dist.sharding(down).spec == (None, "tp")
    assert dist.sharding(model.model.layers[0].self_attn.q_proj.weight).spec == ("tp", None)
    assert dist.sharding(model.model.norm.weight).spec == (None,)
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    grown = [now - then for now, then in zip(chip_memory(), before)]
    assert all(total / 2 <= g < total / 2 * 1.05 for g in grown), (grown, total)
    with torch.tpu.use_eager_mode(mode), torch.no_grad():
        logits = model(ids.to("tpu")).logits.cpu()
    torch.testing.assert_close(logits, expected, rtol=1e-5, atol=1e-5)


def test_compiled_sharded_model_matches_unsharded():
    model = tiny_llama()
    ids = torch.randint(0, CONFIG.vocab_size, (2, 10))
    with torch.no_grad():
        expected = model(ids).logits
    mesh = dist.mesh(2, "tp")
    dist.shard_model(model, model.tp_plan, mesh)
    compiled = torch.compile(model, backend="tpu")
    with torch.no_grad():  # single-chip ids join the sharded weights' mesh
        logits = compiled(ids.to("tpu")).logits
    assert hf_tpu.metrics()["compiles_by_mode"]["COMPILE"] >= 1
    torch.testing.assert_close(logits.cpu(), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_a_sharded_model_finds_an_id_out_of_range_and_single_chip_ops_stay_on_their_chip(compiled):
    """The record of out-of-range indices stays on its chip: a sharded program's finding joins it there, and a
    single-chip op after it runs on that chip alone (docs/design/device-checks.md)."""
    model = tiny_llama()
    dist.shard_model(model, model.tp_plan, dist.mesh(2, "tp"))
    run = torch.compile(model, backend="tpu") if compiled else model
    with torch.no_grad():
        run(torch.randint(0, CONFIG.vocab_size, (2, 10)).to("tpu")).logits.sum().item()
        ids = torch.randint(0, CONFIG.vocab_size, (2, 10))
        ids[1, 3] = CONFIG.vocab_size
        logits = run(ids.to("tpu")).logits
    with pytest.raises(IndexError, match=r"index out of range in self \(aten::embedding called at "):
        logits.sum().item()
    single = torch.nn.functional.embedding(torch.tensor([1], device="tpu"), torch.randn(4, 2, device="tpu"))
    assert dist.sharding(single) is None and single.shape == (1, 2)
    torch._dynamo.reset()


def test_load_state_dict_into_a_sharded_model_keeps_the_shards():
    model = tiny_llama()
    state = {name: torch.randn_like(p) for name, p in model.state_dict().items()}
    mesh = dist.mesh(2, "tp")
    dist.shard_model(model, model.tp_plan, mesh)
    model.load_state_dict(state)
    q_proj = model.model.layers[0].self_attn.q_proj.weight
    assert dist.sharding(q_proj).spec == ("tp", None)
    assert torch.equal(q_proj.cpu(), state["model.layers.0.self_attn.q_proj.weight"])


def test_fully_shard_splits_each_parameter_along_its_first_even_dim_and_trains_as_the_cpu():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(8, 6), torch.nn.Linear(6, 5), torch.nn.Linear(5, 6),
                                torch.nn.Linear(6, 8))
    model[3].weight = model[0].weight  # tied, as an LM's head and embedding
    reference = copy.deepcopy(model)
    ids = torch.randint(0, 8, (4, 3))
    mesh = dist.mesh(2, "dp")
    dist.fully_shard(model, mesh)
    layouts = {name: dist.sharding(p).spec for name, p in model.named_parameters()}
    # 5 rows do not split over 2 chips: the 5x6 weight splits its 6 columns, the length-5 bias stays whole
    assert layouts == {"0.weight": ("dp", None), "1.weight": (None, "dp"), "1.bias": (None,),
                       "2.weight": ("dp", None), "2.bias": ("dp",), "3.bias": ("dp",)}
    assert model[3].weight is model[0].weight
    for net, device in ((reference, "cpu"), (model, "tpu")):
        opt = torch.optim.AdamW(net.parameters(), lr=0.1)
        for _ in range(2):
            net(ids.to(device)).logsumexp(-1).mean().backward()
            opt.step()
            opt.zero_grad()
    for (name, p), expected in zip(model.named_parameters(), reference.parameters()):
        assert dist.sharding(p).spec == layouts[name]
        # AdamW's moments are `zeros_like(p)`, split as the weight they follow
        assert [dist.sharding(t).spec for t in opt.state[p].values() if t.dim()] == [layouts[name]] * 2, name
        torch.testing.assert_close(p.cpu(), expected, rtol=1e-5, atol=1e-5, msg=name)
    with pytest.raises(ValueError, match="not an axis"):
        dist.fully_shard(model, mesh, axis="tp")


@pytest.mark.parametrize("mode", MODES[:2])
def test_like_factories_of_a_split_tensor_are_split_the_same_way(mode):
    mesh = dist.mesh(2, "dp")
    host = torch.randn(4, 6)
    split = dist.shard(host, mesh, ("dp", None))
    gc.collect()
    before = chip_memory()
    with torch.tpu.use_eager_mode(mode):
        made = {"zeros_like": torch.zeros_like(split), "ones_like": torch.ones_like(split),
                "full_like": torch.full_like(split, 2.5),
                "zeros_like float64": torch.zeros_like(split, dtype=torch.float64),
                "empty_like": torch.empty_like(split)}
        for name, t in made.items():
            assert dist.sharding(t) == dist.Sharding(mesh, ("dp", None)), name
        assert [now - then for now, then in zip(chip_memory(), before)] == [12 * 4 * 4 + 12 * 8] * 2
        for name, expected in (("zeros_like", torch.zeros_like(host)), ("ones_like", torch.ones_like(host)),
                               ("full_like", torch.full_like(host, 2.5)),
                               ("zeros_like float64", torch.zeros_like(host, dtype=torch.float64))):
            assert torch.equal(made[name].cpu(), expected), name
        # a view that reads part of the storage, or in another order, gets PyTorch's single-chip result
        for view_of in (lambda t: t[1:], torch.t):
            like = torch.zeros_like(view_of(split))
            assert dist.sharding(like) is None and like.stride() == torch.zeros_like(view_of(host)).stride()
        assert dist.sharding(torch.zeros_like(torch.ones(3, device="tpu"))) is None


def test_a_traced_step_over_split_weights_and_a_single_chip_counter_compiles_once():
    """A single-chip tensor the program overwrites (an optimizer's step count beside split weights) is placed on the
    mesh for the call and keeps that copy: apart from it, the first call donated nothing and the second compiled
    the program again to donate."""
    mesh = dist.mesh(2, "dp")
    weight = dist.shard(torch.randn(4, 6), mesh, ("dp", None))
    count = torch.zeros((), device="tpu")

    def step(x):
        weight.add_(x.sum() * 0.01)
        count.add_(1)
        return weight.sum()

    traced = hf_tpu.jit(step, state=(weight, count))
    x = dist.shard(torch.ones(4, 6), mesh, ("dp", None))
    compiled = []
    for _ in range(3):
        traced(x)
        metrics = hf_tpu.metrics()
        compiled.append(metrics["xla_compiles"] + metrics["disk_cache_hits"])
    assert compiled[0] >= 1 and compiled[1:] == [compiled[0]] * 2, compiled
    assert count.item() == 3 and dist.sharding(count) == dist.Sharding(mesh, ())


def test_shard_model_bad_plans_raise_before_moving_weights():
    mesh = dist.mesh(2, "tp")
    model = torch.nn.Sequential(torch.nn.Linear(4, 5), torch.nn.Linear(5, 4))
    for plan, message in [
        ({"0": "colwise"}, r"0.weight \(colwise\).*size 5"),
        ({"2": "colwise"}, "does not have"),
        ({"0": "diagonal"}, "unsupported tensor-parallel styles"),
    ]:
        with pytest.raises(ValueError, match=message):
            dist.shard_model(model, plan, mesh)
        assert all(p.device.type == "cpu" for p in model.parameters())
    with pytest.raises(ValueError, match="tp_axis"):
        dist.shard_model(model, {"1": "rowwise"}, mesh, tp_axis="dp")


@pytest.mark.parametrize("mode", MODES[:2])
def test_a_large_sharded_result_is_checked_by_its_share_of_each_chip(monkeypatch, mode):
    """An op's large result is checked against the device's free memory before its launch
    (hf_tpu/memory/out_of_memory.py); where XLA may split it over the chips, only its share of each chip is."""
    from hf_tpu.memory import out_of_memory

    mesh = dist.mesh(2, "tp")
    x = dist.shard(torch.ones(2 * 1021, 64), mesh, ("tp",))
    torch.tpu.synchronize()
    total = torch.tpu.memory_allocated() + x.nbytes * 3 // 4  # room on chip 0 for its half of x + x, not for all
    monkeypatch.setattr(out_of_memory, "capacity", lambda index: total, raising=False)
    monkeypatch.setattr(out_of_memory, "LARGE_SHARE", 1 << 40)  # every result is large
    with torch.tpu.use_eager_mode(mode):
        first = x + x
        torch.tpu.synchronize()
        assert dist.sharding(first) == dist.Sharding(mesh, ("tp", None))
        with pytest.raises(torch.OutOfMemoryError, match=r"aten::add.Tensor of .* split over 2 chips at best, asks"):
            x + x


def test_eight_chips_forward_and_data_times_tensor_parallel_step():
    env = dict(os.environ, HF_TPU_NUM_DEVICES="8", HF_TPU_PLATFORM="cpu")
    done = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "2 x 4 data x tensor parallel training step matches one chip" in done.stdout


# --- Run as a script (by the test above) with 8 simulated chips.


def check_forward_sharded_1_2_4_8_ways(ids):
    with torch.no_grad():
        expected = tiny_llama()(ids).logits
    for chips in (1, 2, 4, 8):
        model = tiny_llama()  # the same weights each time
        dist.shard_model(model, model.tp_plan, dist.mesh(chips, "tp"))
        with torch.no_grad():
            logits = model(ids.to("tpu")).logits.cpu()
        torch.testing.assert_close(logits, expected, rtol=1e-5, atol=1e-5)
        print(f"forward on {chips} chips matches")


def train_step(model, ids):
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    loss = model(ids, labels=ids).loss
    loss.backward()
    optimizer.step()
    return loss.detach().cpu(), {name: p.detach().cpu() for name, p in model.named_parameters()}


def check_data_times_tensor_parallel_step(ids):
    expected_loss, expected_params = train_step(tiny_llama().train().to("tpu:0"), ids.to("tpu:0"))
    mesh = dist.mesh((2, 4), ("dp", "tp"))
    model = tiny_llama().train()
    dist.shard_model(model, model.tp_plan, mesh)
    batch = dist.shard(ids, mesh, ("dp", None))
    loss, params = train_step(model, batch)
    torch.testing.assert_close(loss, expected_loss, rtol=1e-5, atol=1e-5)
    for name, value in expected_params.items():
        torch.testing.assert_close(params[name], value, rtol=1e-5, atol=1e-5, msg=name)
    print("2 x 4 data x tensor parallel training step matches one chip")


if __name__ == "__main__":
    assert torch.tpu.device_count() == 8, "run with HF_TPU_NUM_DEVICES=8"
    inputs = torch.randint(0, CONFIG.vocab_size, (4, 12), generator=torch.Generator().manual_seed(1))
    # deferred: a whole step compiles as a few programs, where strict mode compiles every op twice
    # (single chip and sharded), which doubles this test's time on a cold compilation cache
    with torch.tpu.use_eager_mode("DEFER_AND_FUSE"):
        check_forward_sharded_1_2_4_8_ways(inputs)
        check_data_times_tensor_parallel_step(inputs)


@pytest.fixture(scope="module")
def llama_checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-llama-tp")
    tiny_llama().save_pretrained(path)
    return path


def test_from_pretrained_tp_plan_auto_shards_over_the_chips_and_generates(llama_checkpoint):
    from transformers import AutoModelForCausalLM

    cpu = AutoModelForCausalLM.from_pretrained(llama_checkpoint)
    gc.collect()
    before = chip_memory()
    tpu = AutoModelForCausalLM.from_pretrained(llama_checkpoint, device_map="tpu", tp_plan="auto")
    assert tpu.config._attn_implementation == "tpu"
    assert dist.sharding(tpu.model.layers[0].self_attn.q_proj.weight).spec == ("tp", None)
    assert dist.sharding(tpu.model.layers[0].mlp.down_proj.weight).spec == (None, "tp")
    total = sum(p.numel() * p.element_size() for p in tpu.parameters())
    grown = [now - then for now, then in zip(chip_memory(), before)]
    assert all(g < total * 0.55 for g in grown), (grown, total)
    ids = torch.tensor([[3, 14, 15, 92, 65]])
    with torch.no_grad():
        torch.testing.assert_close(tpu(ids.to("tpu")).logits.cpu(), cpu(ids).logits, rtol=1e-5, atol=1e-5)
    expected = cpu.generate(ids, max_new_tokens=6, do_sample=False)
    assert torch.equal(tpu.generate(ids.to("tpu"), max_new_tokens=6, do_sample=False).cpu(), expected)


def static_caches_made(monkeypatch) -> list:
    """The `StaticCache`s made from now on (the one generate() decodes with: a result returns Transformers' own)."""
    from transformers import StaticCache

    made, init = [], StaticCache.__init__
    monkeypatch.setattr(StaticCache, "__init__", lambda self, *a, **k: made.append(self) or init(self, *a, **k))
    return made


def generate_holding_the_cache(model, ids, made: list):
    """generate()'s sequences, the static cache it decoded with (the last of `made`), and the bytes each chip frees
    when that cache is dropped."""
    sequences = model.generate(ids.to("tpu"), max_new_tokens=6, do_sample=False).cpu()
    layers = made.pop().layers
    layouts = [(dist.sharding(layer.keys), dist.sharding(layer.values)) for layer in layers]
    cache_bytes = sum(layer.keys.nbytes + layer.values.nbytes for layer in layers)
    gc.collect()
    holding = chip_memory()
    del layers
    gc.collect()
    return sequences, layouts, cache_bytes, [then - now for then, now in zip(holding, chip_memory())]


def test_generate_shards_the_static_cache_by_heads(llama_checkpoint, monkeypatch):
    from transformers import AutoModelForCausalLM

    ids = torch.tensor([[3, 14, 15, 92, 65], [7, 1, 8, 2, 8]])
    expected = AutoModelForCausalLM.from_pretrained(llama_checkpoint).generate(ids, max_new_tokens=6, do_sample=False)
    single_chip = AutoModelForCausalLM.from_pretrained(llama_checkpoint, device_map="tpu")
    made = static_caches_made(monkeypatch)
    assert torch.equal(generate_holding_the_cache(single_chip, ids, made)[0], expected)
    tpu = AutoModelForCausalLM.from_pretrained(llama_checkpoint, device_map="tpu", tp_plan="auto")
    hf_tpu.reset_metrics()
    sequences, layouts, cache_bytes, freed = generate_holding_the_cache(tpu, ids, made)
    assert hf_tpu.metrics()["compiles_by_mode"]["COMPILE"] >= 1  # the decoding step is compiled
    assert torch.equal(sequences, expected)
    mesh = dist.sharding(tpu.model.embed_tokens.weight).mesh
    assert layouts == [(dist.Sharding(mesh, (None, "tp", None, None)),) * 2] * CONFIG.num_hidden_layers
    # each chip held half of every layer's keys and values (plus a few scalars: lengths, positions)
    assert all(cache_bytes / 2 <= f < cache_bytes / 2 + 1024 for f in freed), (freed, cache_bytes)
    hf_tpu.reset_metrics()
    again, layouts_again, _, _ = generate_holding_the_cache(tpu, ids, made)
    assert hf_tpu.metrics()["compiles"] == 0
    assert torch.equal(again, expected) and layouts_again == layouts


def test_generate_replicates_a_cache_whose_heads_do_not_split_and_warns(monkeypatch):
    """`shard_model` accepts a tp degree that divides heads * head_dim but not the key/value heads."""
    config = LlamaConfig(**{**CONFIG.to_dict(), "num_key_value_heads": 1})
    torch.manual_seed(0)
    cpu = LlamaForCausalLM(config).eval()
    ids = torch.tensor([[3, 14, 15, 92, 65]])
    expected = cpu.generate(ids, max_new_tokens=4, do_sample=False)
    tpu = dist.shard_model(cpu, cpu.tp_plan, dist.mesh(2, "tp"))
    made = static_caches_made(monkeypatch)
    with pytest.warns(UserWarning, match="do not divide its 1 key/value heads"):
        out = tpu.generate(ids.to("tpu"), max_new_tokens=4, do_sample=False)
    assert torch.equal(out.cpu(), expected)
    assert dist.sharding(made[-1].layers[0].keys).spec[1] is None  # (the partitioner may split head_dim)


def test_tensor_parallel_load_rejects_bad_sizes_before_loading(llama_checkpoint, tmp_path):
    from transformers import AutoModelForCausalLM

    with pytest.raises(ValueError, match="needs 4 tpu chips"):
        AutoModelForCausalLM.from_pretrained(llama_checkpoint, device_map="tpu", tp_size=4)
    odd = LlamaConfig(**{**CONFIG.to_dict(), "num_attention_heads": 6, "num_key_value_heads": 3, "hidden_size": 48})
    LlamaForCausalLM(odd).save_pretrained(tmp_path)
    gc.collect()
    before = chip_memory()
    with pytest.raises(ValueError, match="does not divide num_key_value_heads=3"):
        AutoModelForCausalLM.from_pretrained(tmp_path, device_map="tpu", tp_plan="auto")
    assert chip_memory() == before


def _tiny_flux(heads=2, pooled_projection_dim=32):
    from diffusers import FluxTransformer2DModel

    torch.manual_seed(0)
    return FluxTransformer2DModel(patch_size=1, in_channels=4, num_layers=1, num_single_layers=1,
                                  attention_head_dim=16, num_attention_heads=heads, joint_attention_dim=32,
                                  pooled_projection_dim=pooled_projection_dim, axes_dims_rope=(4, 4, 8))


def _tiny_flux_pipeline():
    """FluxPipeline on 16x16 images: a VAE with one latent channel (4 once Flux packs 2x2 patches), the
    examples' 2-layer CLIP (hidden size 16, the pooled projection) and a 1-layer T5 (the joint attention)."""
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxPipeline
    from transformers import CLIPTextModel, T5Config, T5EncoderModel

    from examples.text_to_image import _clip_config, tiny_tokenizer

    transformer = _tiny_flux(pooled_projection_dim=16)
    vae = AutoencoderKL(sample_size=16, in_channels=3, out_channels=3, block_out_channels=(8, 16), latent_channels=1,
                        down_block_types=("DownEncoderBlock2D",) * 2, up_block_types=("UpDecoderBlock2D",) * 2,
                        norm_num_groups=4, use_quant_conv=False, use_post_quant_conv=False, shift_factor=0.1159,
                        scaling_factor=0.3611)
    t5 = T5EncoderModel(T5Config(vocab_size=1000, d_model=32, d_kv=8, d_ff=64, num_layers=1, num_heads=4))
    return FluxPipeline(scheduler=FlowMatchEulerDiscreteScheduler(), vae=vae, text_encoder=CLIPTextModel(_clip_config()),
                        tokenizer=tiny_tokenizer(), text_encoder_2=t5, tokenizer_2=tiny_tokenizer(), transformer=transformer)


def test_diffusers_pipeline_with_a_sharded_transformer_gives_the_unsharded_image(tmp_path):
    """Diffusers 0.42 gives Flux, Flux 2 and QwenImage a `_tp_plan`, not SD3: the full pipeline is Flux."""
    from diffusers import DiffusionPipeline, FluxTransformer2DModel
    from diffusers.models._modeling_parallel import TensorParallelConfig

    _tiny_flux_pipeline().save_pretrained(tmp_path)

    def image(pipe):
        pipe.set_progress_bar_config(disable=True)
        # deferred: each step is a few fused programs (strict mode compiles every op once, which is slow on a
        # cold compilation cache); the values are the strict mode's
        with torch.tpu.use_eager_mode("DEFER_AND_FUSE"):
            return pipe("a photo of a cat", num_inference_steps=2, height=16, width=16, max_sequence_length=16,
                        generator=torch.Generator().manual_seed(0), output_type="pt").images.cpu()

    expected = image(DiffusionPipeline.from_pretrained(tmp_path))
    pipe = DiffusionPipeline.from_pretrained(tmp_path).to("tpu")
    single_chip = image(pipe)
    pipe.transformer = FluxTransformer2DModel.from_pretrained(
        tmp_path, subfolder="transformer", parallel_config=TensorParallelConfig(tp_degree=2))
    assert dist.sharding(pipe.transformer.transformer_blocks[0].attn.to_q.weight).spec == ("tp", None)
    sharded = image(pipe)
    # float32 images in [0, 1]; measured differences are below 5e-7
    torch.testing.assert_close(single_chip, expected, rtol=0, atol=1e-5)
    torch.testing.assert_close(sharded, expected, rtol=0, atol=1e-5)
    torch.testing.assert_close(sharded, single_chip, rtol=0, atol=1e-5)


def test_diffusers_tensor_parallel_config_shards_over_the_chips(tmp_path):
    from diffusers import FluxTransformer2DModel
    from diffusers.models._modeling_parallel import ParallelConfig, TensorParallelConfig

    _tiny_flux().save_pretrained(tmp_path)
    cpu = FluxTransformer2DModel.from_pretrained(tmp_path)
    tpu = FluxTransformer2DModel.from_pretrained(
        tmp_path, parallel_config=ParallelConfig(tensor_parallel_config=TensorParallelConfig(tp_degree=2)))
    assert dist.sharding(tpu.transformer_blocks[0].attn.to_q.weight).spec == ("tp", None)
    assert dist.sharding(tpu.single_transformer_blocks[0].proj_out.weight).spec == (None, "tp")  # PackedRowwise
    g = torch.Generator().manual_seed(0)
    inputs = dict(hidden_states=torch.randn(1, 16, 4, generator=g), encoder_hidden_states=torch.randn(1, 8, 32, generator=g),
                  pooled_projections=torch.randn(1, 32, generator=g), timestep=torch.tensor([0.5]),
                  img_ids=torch.zeros(16, 3), txt_ids=torch.zeros(8, 3))
    with torch.no_grad():
        expected = cpu(**inputs).sample
        actual = tpu(**{name: value.to("tpu") for name, value in inputs.items()}).sample
    torch.testing.assert_close(actual.cpu(), expected, rtol=1e-5, atol=1e-5)


def test_diffusers_tensor_parallel_rejects_bad_degrees_before_loading(tmp_path):
    from diffusers import FluxTransformer2DModel
    from diffusers.models._modeling_parallel import TensorParallelConfig

    _tiny_flux(heads=3).save_pretrained(tmp_path)
    gc.collect()
    before = chip_memory()
    with pytest.raises(ValueError, match="needs 4 tpu chips"):
        FluxTransformer2DModel.from_pretrained(tmp_path, parallel_config=TensorParallelConfig(tp_degree=4))
    with pytest.raises(ValueError, match="does not divide num_attention_heads=3"):
        FluxTransformer2DModel.from_pretrained(tmp_path, parallel_config=TensorParallelConfig(tp_degree=2))
    assert chip_memory() == before


# (in this file, not tests/core: once a sharded array exists, a process's eager ops take the Python path)
def test_inputs_of_a_sharded_call_keep_their_own_arrays_after_a_fallback(caplog):
    """A call meeting a sharded tensor runs on copies of its single-chip inputs placed on the mesh; a trace
    that then falls back leaves every input holding its own array, not those copies (which, shared by the
    eager fallback's programs, were donated twice)."""
    from hf_tpu.memory import buffer

    caplog.set_level(logging.WARNING, logger="hf_tpu.compile")
    mesh = dist.mesh((2,), ("tp",))
    weight = dist.shard(torch.randn(4, 4), mesh, ("tp", None))
    counter = {"calls": 0}
    single = torch.ones(4, device="tpu")

    def counted(x):
        counter["calls"] += 1  # a Python side effect: the call falls back
        return weight @ x + single

    x = torch.randn(4, device="tpu")
    torch.tpu.synchronize()  # defer-and-fuse: `single` holds its computed array, not a pending one
    own = buffer.buffer_of(single).array
    out = hf_tpu.jit(counted)(x)
    assert buffer.buffer_of(single).array is own and counter["calls"] == 1
    assert sum("runs without hf_tpu.jit's trace" in r.getMessage() for r in caplog.records) == 1
    torch.testing.assert_close(out.cpu(), weight.cpu() @ x.cpu() + 1)
