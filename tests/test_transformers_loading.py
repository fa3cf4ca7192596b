"""A causal LM saved from a config, loaded back with device_map="tpu", generating the CPU's tokens."""

import pytest
import torch


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=128, max_position_embeddings=64)
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("tiny-llama")
    LlamaForCausalLM(config).save_pretrained(path)
    return path


@pytest.mark.parametrize("device_map", ["tpu", {"": "tpu"}])
@pytest.mark.parametrize("mode", ["DEFER_NEVER", "DEFER_AND_FUSE"])
def test_device_map_tpu_generates_the_cpu_tokens(checkpoint, device_map, mode):
    from transformers import AutoModelForCausalLM

    cpu = AutoModelForCausalLM.from_pretrained(checkpoint)
    tpu = AutoModelForCausalLM.from_pretrained(checkpoint, device_map=device_map)
    assert all(p.device.type == "tpu" for p in tpu.parameters())
    prompt = torch.tensor([[3, 14, 15, 92, 65]])
    expected = cpu.generate(prompt, max_new_tokens=8, do_sample=False)
    with torch.tpu.use_eager_mode(mode):
        actual = tpu.generate(prompt.to("tpu"), max_new_tokens=8, do_sample=False)
    assert torch.equal(actual.cpu(), expected)


def test_save_pretrained_from_tpu_loads_bit_exactly_on_cpu(checkpoint, tmp_path):
    from transformers import AutoModelForCausalLM

    tpu = AutoModelForCausalLM.from_pretrained(checkpoint, device_map="tpu")
    tpu.save_pretrained(tmp_path)
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    original = AutoModelForCausalLM.from_pretrained(checkpoint)
    for (name, a), (_, b) in zip(reloaded.state_dict().items(), original.state_dict().items()):
        assert torch.equal(a, b), name
