"""The per-architecture compatibility table: its data, the lookup/apply/warn API, `hf-tpu compat`, and the
generated section of docs/compatibility.md."""

import warnings

import pytest

from hf_tpu import cli, model_patches
from hf_tpu.cli import compat


def test_every_entry_has_the_required_fields_and_a_valid_status():
    table = model_patches.load_table()
    assert table["architectures"], "the table is empty: run `hf-tpu sweep --write`"
    for model_type, entry in table["architectures"].items():
        assert set(model_patches.REQUIRED_FIELDS) <= entry.keys(), model_type
        assert entry["status"] in model_patches.STATUSES, model_type
        assert set(model_patches.VERSION_FIELDS) <= entry["versions"].keys(), model_type
        assert all(name in model_patches.PATCHES for name in entry["patches"]), model_type
        assert (entry["status"] == "works with patches") == bool(entry["patches"]), model_type
        if entry["status"] == "fails":
            assert entry["limits"], f"{model_type} fails without a reason"


def test_lookup_and_patches_for():
    assert model_patches.lookup("llama")["status"] == "works"
    assert model_patches.lookup("not-an-architecture") is None
    assert model_patches.patches_for("not-an-architecture") == []


@pytest.fixture
def synthetic_table(monkeypatch):
    """A table with one patched and one failing architecture, and a patch that counts its calls."""
    calls = []
    entry = dict(checked="2025-01-01", versions=dict.fromkeys(model_patches.VERSION_FIELDS, "0"), tested_class="X")
    table = {"architectures": {
        "patched": dict(entry, status="works with patches", patches=["count_calls"], limits=""),
        "broken": dict(entry, status="fails", patches=[], limits="NotImplementedError: aten::frobnicate"),
    }, "not_checked": {}}
    monkeypatch.setattr(model_patches, "load_table", lambda: table)
    monkeypatch.setitem(model_patches.PATCHES, "count_calls", calls.append)
    return calls


class _Model:
    def __init__(self, model_type):
        self.config = type("Config", (), {"model_type": model_type})()


def test_apply_runs_each_patch_once_per_model(synthetic_table):
    model = _Model("patched")
    assert model_patches.apply(model) == ["count_calls"]
    assert model_patches.apply(model) == []
    assert synthetic_table == [model]
    assert model_patches.apply(_Model("broken")) == []


def test_warn_if_failing_names_the_reason_and_the_docs(synthetic_table):
    with pytest.warns(UserWarning, match=r"aten::frobnicate.*docs/compatibility\.md"):
        model_patches.warn_if_failing("broken")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model_patches.warn_if_failing("patched")
        model_patches.warn_if_failing("not-an-architecture")


def test_hf_tpu_compat_prints_the_table(capsys):
    assert cli.main(["compat"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert any(line.split()[:2] == ["llama", "works"] for line in lines)
    assert cli.main(["compat", "--markdown"]) == 0
    assert "| `llama` | works |" in capsys.readouterr().out


def test_docs_are_in_sync_with_the_table():
    text = compat._docs_path().read_text(encoding="utf-8")
    assert compat.docs_with_table(text, model_patches.render_markdown()) == text, \
        "docs/compatibility.md is stale: run `hf-tpu compat --write-docs`"
    assert "## Operators" in text  # the op coverage that error messages point to stays on this page


def test_write_docs_replaces_only_the_generated_section(tmp_path):
    page = tmp_path / "compatibility.md"
    page.write_text(f"before\n{compat.GENERATED_BEGIN}\nold table\n{compat.GENERATED_END}\nafter\n")
    assert cli.main(["compat", "--write-docs", "--docs", str(page)]) == 0
    text = page.read_text()
    assert text.startswith("before\n") and text.endswith("after\n") and "old table" not in text
    assert model_patches.render_markdown() in text


def test_unpadded_prompts_patch_turns_prompt_bucketing_off_for_its_model():
    from transformers import LlamaConfig, LlamaForCausalLM

    model = LlamaForCausalLM(LlamaConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                         num_attention_heads=2, vocab_size=32))
    assert getattr(model, "_hf_tpu_pad_prompts", True) and model_patches.pads_prompts(model)
    model_patches.PATCHES["unpadded_prompts"](model)
    assert model._hf_tpu_pad_prompts is False and not model_patches.pads_prompts(model)
    assert model_patches.patches_for("rwkv") == ["unpadded_prompts"]
