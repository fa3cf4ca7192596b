"""`Int8StaticCache` (integrations/transformers/quantized_cache.py): int8 keys and values with a float32 scale per
head and position. Each number comes back within half a step of what was written; `generate()` with it gives the
CPU's tokens with the same cache, on tpu in the device loop traced without Dynamo; its bytes are about half a
bfloat16 cache's."""

import copy

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, StaticCache

import hf_tpu
from hf_tpu.integrations.transformers import Int8StaticCache
from hf_tpu.integrations.transformers.quantized_cache import dequantized, quantized

CONFIG = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, vocab_size=128, max_position_embeddings=128)


@pytest.fixture(scope="module")
def models():
    torch.manual_seed(0)
    cpu = LlamaForCausalLM(CONFIG).eval()
    return cpu, copy.deepcopy(cpu).to("tpu")


@pytest.mark.parametrize("device", ["cpu", "tpu"])
def test_each_number_comes_back_within_half_a_step_of_its_vector(device):
    torch.manual_seed(1)
    states = torch.randn(2, 3, 5, 16) * torch.logspace(-3, 3, 5)[:, None]  # vectors of very different sizes
    states[0, 0, 0] = 0  # a vector of zeros comes back as zeros
    numbers, scale = quantized(states.to(device))
    assert numbers.dtype == torch.int8 and scale.dtype == torch.float32 and scale.shape == (2, 3, 5, 1)
    back = dequantized(numbers, scale, torch.float32).cpu()
    step = states.abs().amax(-1, keepdim=True) / 127
    assert (back - states).abs().le(step / 2 * (1 + 1e-5)).all()
    assert torch.equal(back[0, 0, 0], torch.zeros(16))
    if device == "tpu":
        cpu_numbers, cpu_scale = quantized(states)
        assert torch.equal(numbers.cpu(), cpu_numbers)
        torch.testing.assert_close(scale.cpu(), cpu_scale, rtol=1e-6, atol=0)  # XLA's division: within an ulp


def test_generate_with_an_int8_cache_gives_the_cpus_tokens_in_the_device_loop_without_dynamo(models):
    import torch._dynamo.utils

    cpu, tpu = models
    torch.manual_seed(2)
    ids = torch.randint(3, 128, (2, 12))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0  # a left-padded row
    expected = cpu.generate(ids, attention_mask=mask, cache=Int8StaticCache(config=CONFIG, max_cache_len=48),
                            max_new_tokens=16, do_sample=False, eos_token_id=None)
    cache = Int8StaticCache(config=CONFIG, max_cache_len=48)
    torch._dynamo.utils.counters.clear()
    hf_tpu.reset_metrics()
    actual = tpu.generate(ids.to("tpu"), attention_mask=mask.to("tpu"), cache=cache, max_new_tokens=16,
                          do_sample=False, eos_token_id=None)
    assert torch.equal(actual.cpu(), expected)
    assert hf_tpu.metrics()["compiles_by_mode"].get("COMPILE") == 1  # the decode loop, one program
    assert not torch._dynamo.utils.counters["frames"], dict(torch._dynamo.utils.counters["frames"])
    layer = cache.layers[0]
    assert (layer.keys.dtype, layer.key_scales.dtype, layer.keys.device.type) == (torch.int8, torch.float32, "tpu")
    assert int(layer.cumulative_length) == 12 + 15  # the last token is returned, not written


def test_an_int8_cache_holds_about_half_a_bfloat16_caches_bytes_and_gives_its_tokens_here(models):
    """Per head and position: head_dim bytes and a 4-byte scale, against 2 x head_dim bytes (this model's heads of
    16: 0.625; heads of 128: 0.52). On this tiny model the tokens are the bfloat16 cache's."""
    cpu, _ = models
    model = copy.deepcopy(cpu).to(torch.bfloat16)
    ids = torch.randint(3, 128, (1, 10), generator=torch.Generator().manual_seed(3))
    caches = Int8StaticCache(config=CONFIG, max_cache_len=32), StaticCache(config=CONFIG, max_cache_len=32)
    tokens = [model.generate(ids, cache=cache, max_new_tokens=12, do_sample=False, eos_token_id=None)
              for cache in caches]
    assert torch.equal(*tokens)
    int8, bf16 = (sum(t.nbytes for layer in cache.layers for t in vars(layer).values()
                      if isinstance(t, torch.Tensor) and t.dim() == 4) for cache in caches)
    head_dim = CONFIG.hidden_size // CONFIG.num_attention_heads
    assert int8 / bf16 == (head_dim + 4) / (2 * head_dim)


def test_beam_search_reorders_the_scales_with_the_numbers(models):
    cpu, tpu = models
    ids = torch.randint(3, 128, (1, 8), generator=torch.Generator().manual_seed(4))
    kwargs = dict(max_new_tokens=6, num_beams=3, do_sample=False, eos_token_id=None)
    expected = cpu.generate(ids, cache=Int8StaticCache(config=CONFIG, max_cache_len=32), **kwargs)
    assert torch.equal(tpu.generate(ids.to("tpu"), cache=Int8StaticCache(config=CONFIG, max_cache_len=32),
                                    **kwargs).cpu(), expected)
