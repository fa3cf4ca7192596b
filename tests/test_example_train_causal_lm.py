"""examples/train_causal_lm.py: its Trainer run and its Accelerate loop on tpu give the CPU's losses, and
it writes its losses and their plot."""

import importlib.util
import json
from pathlib import Path

import torch

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "train_causal_lm.py"


def load_example():
    spec = importlib.util.spec_from_file_location("train_causal_lm", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_example_trains_on_tpu_with_the_cpu_losses(tmp_path):
    from accelerate.state import AcceleratorState

    example = load_example()
    runs = {}
    try:
        for device in ("cpu", "tpu"):
            AcceleratorState._reset_state(reset_partial_state=True)
            runs[device] = example.main(["--device", device, "--steps", "3", "--seq-len", "32",
                                         "--output-dir", str(tmp_path / device)])
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)
    for name in ("Trainer", "Accelerate loop"):
        cpu, tpu = torch.tensor(runs["cpu"][name]), torch.tensor(runs["tpu"][name])
        assert len(tpu) == 3 and ((tpu - cpu).abs() / cpu.abs()).max().item() < 1e-4, (name, tpu, cpu)
        assert tpu[-1] < tpu[0]  # it learns
    assert json.loads((tmp_path / "tpu" / "losses.json").read_text()) == runs["tpu"]
    assert (tmp_path / "tpu" / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_by_default_it_writes_into_the_temporary_directory_not_the_one_it_runs_from():
    import tempfile

    output_dir = load_example().parse_args([]).output_dir
    assert output_dir.is_absolute() and output_dir.parent == Path(tempfile.gettempdir()), output_dir
