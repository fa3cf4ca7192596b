"""The `hf-tpu` command line's handling of what a new user types: bad arguments, where it writes, what it
leaves behind."""

import pytest

from hf_tpu import cli


def _exit_code(argv) -> int:
    with pytest.raises(SystemExit) as exited:
        cli.main(argv)
    return exited.value.code


def test_demo_with_a_missing_model_folder_is_a_one_line_error(tmp_path, capsys):
    missing = tmp_path / "nonexistent"
    assert _exit_code(["demo", "--model", str(missing)]) == 2
    err = capsys.readouterr().err
    assert "--model" in err and "does not exist" in err and str(missing) in err
    assert "Traceback" not in err


def test_demo_with_a_folder_that_is_not_a_model_is_a_one_line_error(tmp_path, capsys):
    assert _exit_code(["demo", "--model", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "--model" in err and "not a model folder" in err and "config.json" in err


def _fake_package_root(monkeypatch, root, checkout: bool):
    """Points the located package root at `root`, laid out as a checkout (pyproject.toml beside the package's
    folders) or as a normal install's site-packages/hf_tpu (which also holds model_patches/table.json)."""
    from hf_tpu.cli import _checkout, compat

    (root / "model_patches").mkdir(parents=True)
    (root / "model_patches" / "table.json").write_text('{"architectures": {}, "not_checked": {}}\n')
    (root / "docs").mkdir()
    (root / "docs" / "compatibility.md").write_text(f"before\n{compat.GENERATED_BEGIN}\nold\n{compat.GENERATED_END}\n")
    if checkout:
        (root / "pyproject.toml").write_text('[project]\nname = "hf-tpu"\n')
    monkeypatch.setattr(_checkout, "package_root", lambda: root)
    return root


def test_compat_write_docs_refuses_to_write_into_an_installed_package(tmp_path, monkeypatch, capsys):
    root = _fake_package_root(monkeypatch, tmp_path / "hf_tpu", checkout=False)
    before = (root / "docs" / "compatibility.md").read_text()
    assert cli.main(["compat", "--write-docs"]) == 2
    err = capsys.readouterr().err
    assert "not an editable install" in err and "--docs PATH" in err
    assert (root / "docs" / "compatibility.md").read_text() == before


def test_compat_write_docs_writes_the_checkouts_page(tmp_path, monkeypatch):
    root = _fake_package_root(monkeypatch, tmp_path / "checkout", checkout=True)
    assert cli.main(["compat", "--write-docs"]) == 0
    assert "old" not in (root / "docs" / "compatibility.md").read_text()


def test_sweep_write_refuses_to_write_into_an_installed_package_before_sweeping(tmp_path, monkeypatch, capsys):
    from hf_tpu.cli import sweep

    root = _fake_package_root(monkeypatch, tmp_path / "hf_tpu", checkout=False)
    monkeypatch.setattr(sweep, "run_sweep", lambda *a, **k: pytest.fail("swept without a table to write"))
    assert cli.main(["sweep", "--only", "llama", "--write"]) == 2
    err = capsys.readouterr().err
    assert "not an editable install" in err and "--table PATH" in err
    assert (root / "model_patches" / "table.json").read_text() == '{"architectures": {}, "not_checked": {}}\n'


def _one_result_sweep(monkeypatch):
    from hf_tpu.cli import sweep

    result = sweep.Result("llama", "causal-lm", "LlamaForCausalLM", "passes", "max abs diff 0")

    def run_sweep(jobs_list, jobs=1, timeout=0.0, on_result=None):
        on_result(result)
        return [result]

    monkeypatch.setattr(sweep, "run_sweep", run_sweep)


def test_sweep_write_updates_the_checkouts_table_or_the_table_given(tmp_path, monkeypatch):
    import json

    _one_result_sweep(monkeypatch)
    root = _fake_package_root(monkeypatch, tmp_path / "checkout", checkout=True)
    assert cli.main(["sweep", "--only", "llama", "--write"]) == 0
    assert json.loads((root / "model_patches" / "table.json").read_text())["architectures"]["llama"]["status"] == "works"
    given = tmp_path / "elsewhere" / "table.json"
    given.parent.mkdir()
    assert cli.main(["sweep", "--only", "llama", "--table", str(given)]) == 0
    assert "llama" in json.loads(given.read_text())["architectures"]


@pytest.mark.parametrize("only", ["", ",", " , "])
def test_sweep_with_an_empty_selection_is_an_argument_error(only, monkeypatch, capsys):
    from hf_tpu.cli import sweep

    monkeypatch.setattr(sweep, "run_sweep", lambda *a, **k: pytest.fail("an empty --only started a sweep"))
    assert _exit_code(["sweep", "--only", only]) == 2
    assert "argument --only" in capsys.readouterr().err


def test_sweep_summary_states_results_without_a_target_figure():
    from hf_tpu.cli import sweep

    results = [sweep.Result("llama", "causal-lm", "LlamaForCausalLM", "passes"),
               sweep.Result("bert", "masked-lm", "BertForMaskedLM", "fails-on-tpu", "RuntimeError: x")]
    text = sweep.summary(results)
    assert "1/2 = 50% pass on tpu" in text
    assert "goal" not in text.lower()


def test_demo_leaves_nothing_in_the_temp_dir(tmp_path, monkeypatch, capsys):
    import tempfile

    temp_dir = tmp_path / "tmp"
    temp_dir.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(temp_dir))
    # torch.compile's own per-user cache folder (torchinductor_<user>, one for every run, reused) is PyTorch's,
    # not the demo's: it goes elsewhere here, so that only what the demo itself leaves is counted
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "torch-cache"))
    assert cli.main(["demo"]) == 0
    assert "greedy tokens identical to CPU" in capsys.readouterr().out
    assert list(temp_dir.iterdir()) == []


@pytest.mark.parametrize("option, value, words", [("--limit", "-1", "is not a positive integer"),
                                                  ("--limit", "0", "is not a positive integer"),
                                                  ("--jobs", "0", "is not a positive integer"),
                                                  ("--jobs", "two", "is not a positive integer"),
                                                  ("--timeout", "-5", "is not a positive number of seconds"),
                                                  ("--timeout", "nan", "is not a positive number of seconds")])
def test_sweep_refuses_counts_and_timeouts_that_mean_nothing(option, value, words, monkeypatch, capsys):
    """`--limit -1` swept all but one architecture, `--jobs 0` ran with no worker, `--timeout -5` reported every
    architecture as failed: argparse's usual error instead."""
    from hf_tpu.cli import sweep

    monkeypatch.setattr(sweep, "run_sweep", lambda *a, **k: pytest.fail(f"{option} {value} started a sweep"))
    assert _exit_code(["sweep", option, value]) == 2
    err = capsys.readouterr().err
    assert f"argument {option}" in err and f"{value!r} {words}" in err


def _command(*args, **env):
    """`python -m hf_tpu.cli ...` in a process of its own, as the `hf-tpu` script runs it."""
    import subprocess
    import sys

    from tests.util import cpu_process_env

    return subprocess.Popen([sys.executable, "-m", "hf_tpu.cli", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=cpu_process_env(HF_TPU_CACHE_DIR="", **env))


def test_env_lists_each_malformed_variable_with_its_error():
    """`import hf_tpu` raises for a malformed variable, which made `hf-tpu env`, the command that lists them, die
    with a traceback: it lists each with what it accepts, and its status says the environment is unusable."""
    process = _command("env", HF_TPU_NUM_DEVICES="abc", HF_TPU_PROMPT_BUCKETS="a,b", HF_TPU_KERNEL_BLOCK="100")
    out, err = process.communicate(timeout=300)
    assert process.returncode == 1, err
    assert "Traceback" not in err, err
    rows = {line.split()[0]: line for line in out.splitlines() if line.startswith("  HF_TPU_")}
    assert rows["HF_TPU_NUM_DEVICES"].split()[1:] == ["abc", "env", "MALFORMED:", "expected", "a", "positive",
                                                      "integer"]
    assert "MALFORMED: expected positive lengths separated by commas" in rows["HF_TPU_PROMPT_BUCKETS"]
    assert "MALFORMED: expected a positive multiple of 128" in rows["HF_TPU_KERNEL_BLOCK"]
    assert "MALFORMED" not in rows["HF_TPU_CPU_FALLBACK"]
    assert "malformed: HF_TPU_NUM_DEVICES, HF_TPU_KERNEL_BLOCK, HF_TPU_PROMPT_BUCKETS." in out


def test_the_other_commands_refuse_a_malformed_variable_in_one_line(monkeypatch, capsys):
    monkeypatch.setenv("HF_TPU_KERNEL_BLOCK", "100")
    assert _exit_code(["compat"]) == 2
    assert capsys.readouterr().err == ("hf-tpu compat: error: HF_TPU_KERNEL_BLOCK='100': expected a positive "
                                       "multiple of 128 (`hf-tpu env` lists every variable)\n")


def test_output_into_a_closed_pipe_ends_quietly():
    """`hf-tpu compat | head` ended in a BrokenPipeError traceback: the reader here is gone before the first line."""
    process = _command("compat")
    process.stdout.close()
    _, err = process.communicate(timeout=300)
    assert process.returncode == 1
    assert "Traceback" not in err and "BrokenPipeError" not in err, err


def test_past_the_check_a_command_reads_settings_strictly(monkeypatch, capsys):
    """The `hf-tpu` process starts tolerant (so that env can list what is malformed); a command that passed the
    check reads strictly again: an adapter's variable, registered after the check in that process, raises where
    it is read instead of standing in for its default unseen."""
    from hf_tpu import settings
    from hf_tpu.integrations.transformers import Settings

    monkeypatch.setattr(settings, "_tolerant", True)  # as `import hf_tpu` leaves it in the hf-tpu process
    assert cli.main(["compat"]) == 0
    monkeypatch.setenv("HF_TPU_PROMPT_BUCKETS", "a,b")
    with pytest.raises(ValueError, match="HF_TPU_PROMPT_BUCKETS='a,b': expected positive lengths"):
        Settings()
