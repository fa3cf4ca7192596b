"""`transformers.pipeline` picks its default device by backend name, not through `torch.accelerator`, so it
takes the CPU even with `tpu` there; `device="tpu"` and `device_map="tpu"` put it on `tpu` (README,
Troubleshooting)."""

import pytest
import torch

import hf_tpu  # noqa: F401  (registers the tpu device)


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    words = Tokenizer(models.WordLevel({"[UNK]": 0, **{f"w{i}": i + 1 for i in range(60)}}, unk_token="[UNK]"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=words, unk_token="[UNK]", pad_token="[UNK]",
                                        eos_token="[UNK]")
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1, vocab_size=64))
    path = tmp_path_factory.mktemp("tiny-llama")
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


def test_pipeline_default_is_the_cpu_even_with_tpu_the_current_accelerator(tiny_checkpoint):
    from transformers import pipeline

    assert torch.accelerator.current_accelerator().type == "tpu"
    # if this starts failing, Transformers now asks torch.accelerator: update README's Troubleshooting
    assert pipeline("text-generation", model=tiny_checkpoint).device.type == "cpu"


@pytest.mark.parametrize("argument", ["device", "device_map"])
def test_pipeline_on_tpu_when_named(tiny_checkpoint, argument):
    from transformers import pipeline

    cpu = pipeline("text-generation", model=tiny_checkpoint, device="cpu")
    tpu = pipeline("text-generation", model=tiny_checkpoint, **{argument: "tpu"})
    assert tpu.device.type == "tpu" and next(tpu.model.parameters()).device.type == "tpu"
    kwargs = dict(max_new_tokens=3, do_sample=False)
    assert tpu("w1 w2 w3", **kwargs)[0]["generated_text"] == cpu("w1 w2 w3", **kwargs)[0]["generated_text"]
