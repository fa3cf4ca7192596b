"""Runs the notebooks in this folder top to bottom in a fresh Jupyter kernel, as "Restart Kernel and Run
All Cells" does, and with --write saves them with their outputs (the plots included), which is what the
committed notebooks hold.

Run: python examples/execute_notebooks.py [--small] [--write] [NAME.ipynb ...]   (default: every notebook)

--small sets HF_TPU_NOTEBOOK_SMALL=1 for the kernel: each notebook's first cell reads it and picks a
smaller model and fewer steps, the form the tests run on a CPU. The kernel is Jupyter's `python3`, which
jupyter_client starts with this interpreter (`sys.executable`), so it sees the packages this Python sees.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

FOLDER = Path(__file__).resolve().parent
SMALL_VARIABLE = "HF_TPU_NOTEBOOK_SMALL"
KERNEL = "python3"


def notebooks() -> list[Path]:
    return sorted(FOLDER.glob("*.ipynb"))


def execute(path: Path, *, small: bool, env: dict | None = None, timeout: int = 900):
    """The notebook at `path` executed in a new kernel whose working folder is the notebook's own (so it
    imports the modules beside it) and whose environment is `env` (default: this process's) with the
    small switch set; raises nbclient's CellExecutionError, which names the cell, at the first error."""
    import nbformat
    from nbclient import NotebookClient

    notebook = nbformat.read(path, as_version=4)
    kernel_env = dict(os.environ if env is None else env)
    kernel_env[SMALL_VARIABLE] = "1" if small else "0"
    client = NotebookClient(notebook, kernel_name=KERNEL, timeout=timeout, record_timing=False,
                            resources={"metadata": {"path": str(path.parent)}})
    client.execute(env=kernel_env)
    return notebook


def main(argv=None) -> int:
    import nbformat

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("names", nargs="*", help="notebooks in examples/ (default: all)")
    parser.add_argument("--small", action="store_true", help=f"set {SMALL_VARIABLE}=1 (the tests' size)")
    parser.add_argument("--write", action="store_true", help="save each executed notebook in place")
    args = parser.parse_args(argv)
    paths = [FOLDER / name for name in args.names] or notebooks()
    for path in paths:
        start = time.perf_counter()
        notebook = execute(path, small=args.small)
        print(f"{path.name}: ran in {time.perf_counter() - start:.0f} s", flush=True)
        if args.write:
            nbformat.write(notebook, path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
