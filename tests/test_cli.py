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
