"""The notebooks in examples/ run top to bottom in a Jupyter kernel (nbclient) in their small form
(HF_TPU_NOTEBOOK_SMALL=1), where their own asserts compare `tpu` with the CPU; each leaves nothing in
the temp dir; and the committed notebooks hold the outputs of a full run, plots included.

One test per notebook, so that `pytest -n 2` runs two kernels at once.
"""

import os
import sys
from pathlib import Path

import pytest

from examples import execute_notebooks

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = [path.name for path in execute_notebooks.notebooks()]


def _outputs(notebook, output_type=None):
    return [output for cell in notebook.cells if cell.cell_type == "code" for output in cell.outputs
            if output_type is None or output.output_type == output_type]


def _images(notebook):
    return [output for output in _outputs(notebook) if "image/png" in output.get("data", {})]


def test_there_are_notebooks():
    assert {"text_generation.ipynb", "fine_tuning.ipynb", "sharding.ipynb", "text_to_image.ipynb",
            "custom_kernel.ipynb"} <= set(NOTEBOOKS)


def test_the_kernel_is_this_interpreter():
    """Jupyter's `python3` kernel spec says `python`; jupyter_client starts it as `sys.executable`, so a
    notebook sees this environment's packages (hf_tpu among them) whatever `python` is on the PATH."""
    from jupyter_client.manager import KernelManager

    assert KernelManager(kernel_name=execute_notebooks.KERNEL).format_kernel_cmd()[0] == sys.executable


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_notebook_runs_top_to_bottom(name, tmp_path):
    temp_dir = tmp_path / "tmp"
    temp_dir.mkdir()
    # the sharding notebook picks its number of simulated chips itself (the tests' 2 would leave out 4)
    env = {key: value for key, value in os.environ.items() if key != "HF_TPU_NUM_DEVICES"}
    env.update(HF_TPU_PLATFORM="cpu", TMPDIR=str(temp_dir), TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "torch-cache"))
    notebook = execute_notebooks.execute(ROOT / "examples" / name, small=True, env=env)
    assert _images(notebook), "the notebook showed no plot or image"
    assert list(temp_dir.iterdir()) == [], "the notebook left files in the temp dir"


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_committed_notebook_holds_its_outputs(name):
    """Saved after a full run (`python examples/execute_notebooks.py --write`): every code cell ran, in
    order and without an error, the plots are there, and the first cell says what the notebook shows and
    how to run it on a TPU VM."""
    import nbformat

    notebook = nbformat.read(ROOT / "examples" / name, as_version=4)
    nbformat.validate(notebook)
    counts = [cell.execution_count for cell in notebook.cells if cell.cell_type == "code"]
    assert counts == list(range(1, len(counts) + 1)), counts
    assert not _outputs(notebook, "error")
    assert _images(notebook)
    assert notebook.cells[0].cell_type == "markdown" and "TPU VM" in notebook.cells[0].source
    assert execute_notebooks.SMALL_VARIABLE in notebook.cells[0].source
