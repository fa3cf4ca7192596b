"""`hf-tpu sweep`: tiny configs, the comparison, and the sweep end to end in worker processes."""

import torch

from hf_tpu import cli
from hf_tpu.cli import sweep


def test_tiny_config_shrinks_sizes_and_keeps_special_tokens_in_the_vocabulary():
    config = sweep.tiny_config("qwen2")
    assert (config.hidden_size, config.num_hidden_layers, config.vocab_size) == (64, 2, sweep.TINY_VOCAB)
    assert len(config.layer_types) == 2
    for name in ("bos_token_id", "eos_token_id"):
        value = getattr(config, name)
        assert value is None or sweep.TINY_VOCAB - sweep.SPECIAL_TOKEN_BAND <= value < sweep.TINY_VOCAB


def test_tiny_config_shrinks_sub_configs():
    config = sweep.tiny_config("llava")
    assert config.text_config.hidden_size == 64 and config.vision_config.num_hidden_layers == 2
    assert config.image_token_id < config.text_config.vocab_size


def test_compare_reports_the_largest_difference_and_structure_changes():
    expected = {"logits": torch.zeros(2, 3), "ids": torch.arange(3)}
    assert sweep.compare(expected, {"logits": torch.full((2, 3), 5e-5), "ids": torch.arange(3)}) is None
    assert "max abs diff 0.01" in sweep.compare(expected, {"logits": torch.full((2, 3), 1e-2), "ids": torch.arange(3)})
    assert "values differ" in sweep.compare(expected, {"logits": torch.zeros(2, 3), "ids": torch.arange(1, 4)})
    assert "structure" in sweep.compare(expected, {"logits": torch.zeros(2, 3)})


def test_sweep_end_to_end_reports_llama_and_bert_passing(capsys):
    assert cli.main(["sweep", "--only", "llama,bert", "--timeout", "120"]) == 0
    out = capsys.readouterr().out
    assert [line.split()[:2] for line in out.splitlines() if line.startswith(("llama ", "bert "))] == [
        ["bert", "passes"], ["llama", "passes"]]
    assert "2/2 = 100% pass on tpu" in out


def test_an_architecture_over_its_timeout_costs_only_itself():
    results = sweep.run_sweep(sweep.architectures(only=["llama"]), timeout=0.01)
    assert [(r.model_type, r.outcome) for r in results] == [("llama", "timeout")]


def test_tiny_config_keeps_the_ratio_of_heads_to_key_value_heads():
    multi_head = sweep.tiny_config("minicpm3")  # multi-head latent attention: as many key/value heads as heads
    assert multi_head.num_key_value_heads == multi_head.num_attention_heads == 4
    grouped = sweep.tiny_config("mixtral")
    assert (grouped.num_attention_heads, grouped.num_key_value_heads) == (4, 2)


def test_zero_weight_matrices_get_random_values_and_zero_biases_stay():
    router = torch.nn.Linear(8, 4)
    torch.nn.init.zeros_(router.weight)
    torch.nn.init.zeros_(router.bias)
    sweep.randomize_zero_matrices(router)
    assert router.weight.std() > 0 and not router.bias.any()


class _Amplifier(torch.nn.Module):
    """A linear layer with huge weights: its float32 output carries rounding error well above ATOL."""

    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(64, 64, bias=False)
        torch.nn.init.normal_(self.linear.weight, std=1e3, generator=torch.Generator().manual_seed(0))

    def forward(self, x):
        return self.linear(x)


def test_float32_rounding_passes_a_result_as_close_to_float64_as_cpu_and_nothing_worse():
    model, inputs = _Amplifier(), {"x": torch.randn(4, 64, generator=torch.Generator().manual_seed(1))}
    with torch.no_grad():
        expected = model(**inputs)
        exact = model.double()(x=inputs["x"].double()).float()
        model.float()
    assert "float32 rounding" in sweep.float32_rounding(model, inputs, expected, exact)
    assert sweep.float32_rounding(model, inputs, expected, expected + 1e-2) == ""


def test_tiny_config_keeps_one_layer_of_each_kind_of_a_hybrid_model():
    config = sweep.tiny_config("lfm3")  # convolution, full and sliding attention layers
    assert config.num_hidden_layers == len(config.layer_types) == 3
    assert set(config.layer_types) == {"conv", "full_attention", "sliding_attention"}


def test_tiny_config_fits_the_rotary_part_into_the_head():
    config = sweep.tiny_config("gptj")
    assert config.rotary_dim <= config.n_embd // config.n_head


def test_tiny_backbone_config_outputs_its_last_layer():
    config = sweep.tiny_config("dinov2")  # the default outputs layer 12
    assert config.out_indices == [config.num_hidden_layers]


def test_a_model_type_mapped_to_several_classes_checks_the_first():
    [(_, task, class_name, _)] = sweep.architectures(only=["deit"])
    assert (task, class_name) == ("image-classification", "DeiTForImageClassification")
