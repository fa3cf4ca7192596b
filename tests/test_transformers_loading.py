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


@pytest.mark.parametrize("device_map", ["auto", 0, "tpu:0"])
def test_device_maps_that_mean_the_accelerator_load_on_tpu(checkpoint, device_map):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(checkpoint, device_map=device_map)
    assert {p.device for p in model.parameters()} == {torch.device("tpu", 0)}


@pytest.mark.parametrize("device_map", ["tpu", {"": "tpu"}])
def test_device_map_tpu_loads_on_the_current_chip(checkpoint, device_map):
    """As "cuda" means the current CUDA device: the weights went to tpu:0 (moved with `.to("tpu")`)
    and the rotary buffers to the current chip."""
    from transformers import AutoModelForCausalLM

    if torch.tpu.device_count() < 2:
        pytest.skip("needs two tpu chips")
    with torch.tpu.device(1):
        model = AutoModelForCausalLM.from_pretrained(checkpoint, device_map=device_map)
    assert {t.device for t in [*model.parameters(), *model.buffers()]} == {torch.device("tpu", 1)}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, "auto"])
def test_dtype_is_applied_on_tpu_as_on_cpu(checkpoint, dtype):
    from transformers import AutoModelForCausalLM

    cpu = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=dtype)
    tpu = AutoModelForCausalLM.from_pretrained(checkpoint, device_map="tpu", dtype=dtype)
    for (name, a), (_, b) in zip(cpu.state_dict().items(), tpu.state_dict().items()):
        assert b.dtype == a.dtype and torch.equal(b.cpu(), a), name


def test_model_moved_with_to_generates_with_a_static_cache(checkpoint, monkeypatch):
    from transformers import AutoModelForCausalLM, StaticCache

    cpu = AutoModelForCausalLM.from_pretrained(checkpoint)
    expected = cpu.generate(torch.tensor([[3, 14, 15]]), max_new_tokens=5, do_sample=False)
    made, init = [], StaticCache.__init__
    monkeypatch.setattr(StaticCache, "__init__", lambda self, *a, **k: made.append(self) or init(self, *a, **k))
    out = cpu.to("tpu").generate(torch.tensor([[3, 14, 15]], device="tpu"), max_new_tokens=5, do_sample=False)
    assert len(made) == 1 and out.device.type == "tpu"
    assert torch.equal(out.cpu(), expected)


def test_a_missing_checkpoint_directory_is_named(tmp_path):
    from transformers import AutoModelForCausalLM

    with pytest.raises(FileNotFoundError, match="does not exist"):
        AutoModelForCausalLM.from_pretrained(tmp_path / "nowhere", device_map="tpu")


@pytest.mark.parametrize("damage", ["truncated", "garbage"])
def test_a_corrupt_safetensors_file_is_named_before_loading(checkpoint, tmp_path, damage):
    import shutil

    from transformers import AutoModelForCausalLM

    shutil.copytree(checkpoint, tmp_path, dirs_exist_ok=True)
    weights = tmp_path / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2] if damage == "truncated" else b"not safetensors" * 8)
    before = torch.tpu.memory_allocated()
    with pytest.raises(OSError, match="model.safetensors is not a readable safetensors file"):
        AutoModelForCausalLM.from_pretrained(tmp_path, device_map="tpu")
    assert torch.tpu.memory_allocated() == before


def test_a_dtype_the_platform_lacks_is_refused_before_loading(checkpoint):
    from transformers import AutoModelForCausalLM

    lacking = next(d for d in (torch.float8_e4m3fn, torch.float64) if d not in torch.tpu.supported_dtypes())
    before = torch.tpu.memory_allocated()
    with pytest.raises(TypeError, match="tpu tensors cannot hold"):
        AutoModelForCausalLM.from_pretrained(checkpoint, device_map="tpu", dtype=lacking)
    assert torch.tpu.memory_allocated() == before


def test_compiled_model_returns_hidden_states_without_a_graph_break(checkpoint):
    """Transformers installs its output-capturing hooks on the first call that asks for hidden states,
    under a lock Dynamo cannot trace; a model loaded onto tpu has them already."""
    from torch._dynamo.utils import counters
    from transformers import AutoModelForCausalLM

    cpu = AutoModelForCausalLM.from_pretrained(checkpoint)
    tpu = AutoModelForCausalLM.from_pretrained(checkpoint, device_map="tpu")
    torch._dynamo.reset()  # past Dynamo's recompile limit (earlier tests' graphs) the forward would run eagerly
    compiled = torch.compile(tpu, backend="tpu")
    prompt = torch.tensor([[3, 14, 15, 92, 65]])
    counters.clear()
    with torch.no_grad():
        for _ in range(2):
            actual = compiled(prompt.to("tpu"), output_hidden_states=True).hidden_states
        expected = cpu(prompt, output_hidden_states=True).hidden_states
    assert not counters["graph_break"], list(counters["graph_break"])
    assert len(actual) == len(expected)
    for a, e in zip(actual, expected):
        torch.testing.assert_close(a.cpu(), e, atol=1e-5, rtol=1e-5)


def test_hooks_a_model_installed_itself_are_not_installed_twice(tmp_path):
    """A model that ran eagerly with hidden states has Transformers' hooks already, on a submodel only for
    a `CLIPTextModelWithProjection` (SDXL's second text encoder): hooking it again from the top returned
    every hidden state twice, and `hidden_states[-2]` was another layer's."""
    from torch._dynamo.utils import counters
    from transformers import CLIPTextConfig, CLIPTextModelWithProjection

    from hf_tpu.integrations.transformers import install_output_capturing_hooks

    config = CLIPTextConfig(hidden_size=32, intermediate_size=37, num_attention_heads=4, num_hidden_layers=2,
                            vocab_size=100, max_position_embeddings=16, projection_dim=32)
    torch.manual_seed(0)
    cpu = CLIPTextModelWithProjection(config).eval()
    tpu = CLIPTextModelWithProjection(config).eval()
    tpu.load_state_dict(cpu.state_dict())
    tpu.to("tpu")
    ids = torch.randint(2, 100, (1, 16))
    with torch.no_grad():
        expected = cpu(ids, output_hidden_states=True).hidden_states
        tpu(ids.to("tpu"), output_hidden_states=True)
        install_output_capturing_hooks(tpu)
        torch._dynamo.reset()  # past Dynamo's recompile limit (earlier tests' graphs) the forward would run eagerly
        compiled = torch.compile(tpu, backend="tpu")
        counters.clear()
        actual = compiled(ids.to("tpu"), output_hidden_states=True).hidden_states
    assert not counters["graph_break"], list(counters["graph_break"])
    assert len(actual) == len(expected)
    for a, e in zip(actual, expected):
        torch.testing.assert_close(a.cpu(), e, atol=1e-5, rtol=1e-5)
