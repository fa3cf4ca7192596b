"""hf-tpu: a native `tpu` device for PyTorch, backed by JAX/XLA.

`import hf_tpu` is all a user does: PyTorch's PrivateUse1 backend becomes `tpu`, `torch.tpu` appears,
and every ATen op on a `tpu` tensor is routed to `hf_tpu.dispatch`. The layers, bottom up, and where new
work goes: docs/design/architecture.md.
"""

from __future__ import annotations

import os as _os
import sys as _sys

from . import settings


def _started_as_the_command_line() -> bool:
    """Whether this process is the `hf-tpu` command (its script, or `python -m hf_tpu.cli`): the command reports
    a malformed HF_TPU_* variable itself, `hf-tpu env` listing it with its error, so importing this package,
    which it does first, must not raise for one."""
    script = _os.path.basename(_sys.argv[0]) if _sys.argv else ""
    if _os.path.splitext(script)[0] in ("hf-tpu", "hf-tpu-script"):  # the script, on Windows hf-tpu.exe
        return True
    argv = getattr(_sys, "orig_argv", [])
    return any(option == "-m" and module == "hf_tpu.cli" for option, module in zip(argv, argv[1:]))


_COMMAND_LINE = _started_as_the_command_line()
if _COMMAND_LINE:
    settings.tolerate_malformed()

from . import platform  # noqa: E402  (before torch: configures JAX before its backends start)

import torch  # noqa: E402

__version__ = "0.1.0"

# the torch releases this package is tested with (pyproject.toml's range); hf_tpu registers kernels for
# ATen's operators by name, and another release renames or drops some of them
SUPPORTED_TORCH = ((2, 13),)


def _check_torch_version() -> None:
    import re

    match = re.match(r"(\d+)\.(\d+)", torch.__version__)
    if match and (int(match[1]), int(match[2])) in SUPPORTED_TORCH:
        return
    if settings.get("HF_TPU_ALLOW_UNSUPPORTED_TORCH"):
        return
    supported = ", ".join(f"{major}.{minor}.x" for major, minor in SUPPORTED_TORCH)
    raise ImportError(
        f"hf_tpu {__version__} supports torch {supported}, and torch {torch.__version__} is installed. Install "
        f"a supported release (pip install torch=={SUPPORTED_TORCH[-1][0]}.{SUPPORTED_TORCH[-1][1]}.0 "
        "--index-url https://download.pytorch.org/whl/cpu), or set HF_TPU_ALLOW_UNSUPPORTED_TORCH=1 to "
        "try anyway (untested: the import may fail later)."
    )


_check_torch_version()
if not _COMMAND_LINE:
    settings.validate()


def _check_privateuse1_is_free() -> None:
    name = torch._C._get_privateuse1_backend_name()
    owner = getattr(torch, name, None) if name != "privateuseone" else None
    if name == "privateuseone" or (name == "tpu" and getattr(owner, "__name__", "") == "hf_tpu.device"):
        return
    hint = {
        "tpu": "Google's TorchTPU (torch_tpu) registers it when torch is imported",
        "jax": "torchax registers it",
    }.get(name, "another package registered it")
    raise ImportError(
        f"hf_tpu cannot register the 'tpu' device: PyTorch's PrivateUse1 backend is already taken as "
        f"'{name}' ({hint}). Only one package can own it per process: uninstall the other package or "
        "run hf_tpu in a process where it is not imported (for torch_tpu, set "
        "TORCH_DEVICE_BACKEND_AUTOLOAD=0)."
    )


_check_privateuse1_is_free()

from .counters import metrics, reset_metrics  # noqa: E402,F401
from .device import backend  # noqa: E402
from .loops import while_loop  # noqa: E402,F401
from .modes import EagerMode  # noqa: E402,F401
from .ops.memory import prefetch_to_cpu, same_values, to_cpu  # noqa: E402,F401

backend.register()


def __getattr__(name: str):
    """`hf_tpu.distributed` loads on first use, so single-chip programs never import it; so does `hf_tpu.jit`
    (`hf_tpu.direct`), with the tracing machinery it shares with `torch.compile`'s backend, and `hf_tpu.scan_layers`,
    which serves that trace."""
    if name == "distributed":
        import importlib

        return importlib.import_module(".distributed", __name__)
    if name == "jit":
        from .direct import jit

        return jit
    if name == "scan_layers":
        from .layer_scan import scan_layers

        return scan_layers
    raise AttributeError(f"module 'hf_tpu' has no attribute {name!r}")


def platform_name() -> str:
    """The JAX platform behind `tpu` in this process: 'tpu', 'gpu' or 'cpu'."""
    return platform.name()


def _load_adapters() -> None:
    """Adapters to other libraries (the Hugging Face ones among them) declare an entry point in the group
    `hf_tpu.adapters`; each is loaded and called once the device is ready. The core names none of them, and
    one that fails is logged as a warning: it never breaks `import hf_tpu`."""
    import importlib.metadata
    import logging

    for entry_point in importlib.metadata.entry_points(group="hf_tpu.adapters"):
        try:
            entry_point.load()()
        except Exception:  # noqa: BLE001 - whatever an adapter raises
            logging.getLogger(__name__).warning("hf_tpu: the adapter %r (%s) could not be loaded", entry_point.name,
                                                entry_point.value, exc_info=True)


_load_adapters()
