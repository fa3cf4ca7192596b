"""Which JAX devices back `tpu`, chosen once per process.

JAX picks the hardware: a TPU through libtpu, else a GPU, else the host CPU (a "virtual TPU").
`HF_TPU_PLATFORM=cpu|gpu|tpu` overrides the choice (cpu keeps JAX off any accelerator) and
`HF_TPU_NUM_DEVICES=N` simulates N chips on the CPU. Both must be read before JAX creates its
backends, so this module is imported first; so must `HF_TPU_COORDINATOR_ADDRESS`,
`HF_TPU_NUM_PROCESSES` and `HF_TPU_PROCESS_ID`, which make this process one of a multi-process run
(docs/design/multi-host.md).
"""

from __future__ import annotations

import functools
import os

from hf_tpu import settings as _settings

_PLATFORM_ALIASES = {"cpu": "cpu", "gpu": "gpu", "cuda": "gpu", "rocm": "gpu", "tpu": "tpu"}


def _configure_jax_before_backends() -> None:
    if _settings.get("HF_TPU_PLATFORM") == "cpu":
        # JAX would still initialise every backend it finds, and libtpu takes the chip's lock (failing when
        # another process holds it). The variable, read when jax is imported, also keeps the processes this
        # one starts off the chip, those that use JAX without hf_tpu included.
        os.environ["JAX_PLATFORMS"] = "cpu"
    num = _settings.get("HF_TPU_NUM_DEVICES")
    if num:
        flag = f"--xla_force_host_platform_device_count={num}"
        flags = os.environ.get("XLA_FLAGS", "")
        if "xla_force_host_platform_device_count" not in flags:
            os.environ["XLA_FLAGS"] = f"{flags} {flag}".strip()


_configure_jax_before_backends()

import jax  # noqa: E402
from jax._src import xla_bridge  # noqa: E402

# PyTorch's default integer type is int64 and float64 is a real dtype there; without x64 JAX would
# silently compute them in 32 bits.
jax.config.update("jax_enable_x64", True)

if _settings.get("HF_TPU_PLATFORM") == "cpu":
    if not xla_bridge.backends_are_initialized():  # jax imported before hf_tpu read the variable at its import
        jax.config.update("jax_platforms", "cpu")
    elif jax.default_backend() != "cpu":
        import warnings

        warnings.warn(f"HF_TPU_PLATFORM=cpu, but JAX started its backends ({jax.default_backend()} among them) "
                      "before hf_tpu was imported, so this process may hold an accelerator: import hf_tpu "
                      "first, or set JAX_PLATFORMS=cpu too", stacklevel=2)


def _unusable_cache_dir() -> str | None:
    """`HF_TPU_CACHE_DIR` where it cannot hold the disk cache (a file, a folder this process may not write), said
    once in a warning that names the variable; None where it can, or where it is empty. JAX, given such a folder,
    would warn at each program that it could not read an entry, and never say which setting to change."""
    path = _settings.get("HF_TPU_CACHE_DIR")
    if not path:
        return None
    try:
        os.makedirs(os.path.join(path, "xla"), exist_ok=True)
        if not os.access(path, os.W_OK | os.X_OK):
            raise PermissionError("not writable")
    except OSError as e:
        import warnings

        warnings.warn(f"HF_TPU_CACHE_DIR={path!r} cannot hold the disk cache ({e}), so this process keeps no "
                      "compiled program on disk: point HF_TPU_CACHE_DIR at a folder it can write, or set it empty "
                      "to turn the disk cache off", stacklevel=4)
        return path
    return None


_UNUSABLE_CACHE_DIR = _unusable_cache_dir()


def cache_dir() -> str:
    """Where compiled programs persist between processes (`HF_TPU_CACHE_DIR`, empty to disable; empty too where
    the folder is unusable)."""
    path = _settings.get("HF_TPU_CACHE_DIR")
    return "" if path == _UNUSABLE_CACHE_DIR else path


if cache_dir():
    # XLA executables are cached on disk by JAX, keyed by the program and the compiler/platform, so
    # a second process starts warm; an unreadable entry is recompiled. JAX compresses them with zstandard
    # (a dependency): about 9x faster than its zlib fallback.
    jax.config.update("jax_compilation_cache_dir", os.path.join(cache_dir(), "xla"))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
if _settings.get("HF_TPU_NUM_DEVICES"):
    try:
        jax.config.update("jax_num_cpu_devices", _settings.get("HF_TPU_NUM_DEVICES"))
    except Exception:  # backends already initialised by the user: the XLA flag above applies
        pass


# initialize_distributed's arguments and the environment variables that stand for them
_DISTRIBUTED_VARIABLES = {
    "coordinator_address": "HF_TPU_COORDINATOR_ADDRESS",
    "num_processes": "HF_TPU_NUM_PROCESSES",
    "process_id": "HF_TPU_PROCESS_ID",
}


def initialize_distributed(coordinator_address: str | None = None, num_processes: int | None = None,
                           process_id: int | None = None) -> None:
    """Join a multi-process run through JAX's distributed runtime, so that meshes span the chips of
    every process (`hf_tpu.distributed.initialize`). Each argument left None is read from its
    environment variable (HF_TPU_COORDINATOR_ADDRESS as host:port of process 0, HF_TPU_NUM_PROCESSES,
    HF_TPU_PROCESS_ID). JAX allows this only before it creates its backends (the first `tpu` tensor
    does): call it right after `import hf_tpu`, or set the three variables and `import hf_tpu` joins."""
    given = dict(coordinator_address=coordinator_address, num_processes=num_processes, process_id=process_id)
    settings = {arg: _settings.get(variable) if given[arg] is None else given[arg]
                for arg, variable in _DISTRIBUTED_VARIABLES.items()}
    missing = [f"{arg} ({_DISTRIBUTED_VARIABLES[arg]})" for arg, value in settings.items() if value in (None, "")]
    if missing:
        known = [f"{arg}={value!r}" for arg, value in settings.items() if value not in (None, "")]
        raise ValueError(
            f"a multi-process run needs {', '.join(missing)} as well as {', '.join(known) or 'the others'}: "
            "pass them to hf_tpu.distributed.initialize() or set all three environment variables in every "
            "process (none of them for a single-process run)"
        )
    for arg in ("num_processes", "process_id"):
        try:
            settings[arg] = int(settings[arg])
        except ValueError:
            raise ValueError(f"{_DISTRIBUTED_VARIABLES[arg]}={settings[arg]!r}: expected an integer") from None
    if jax.distributed.is_initialized():
        raise RuntimeError(
            f"this process already joined a multi-process run (process {jax.process_index()} of "
            f"{jax.process_count()}); initialize once, either with the HF_TPU_* variables or by calling it"
        )
    if xla_bridge.backends_are_initialized():
        raise RuntimeError(
            "joining a multi-process run must happen before JAX creates its backends, and they already exist "
            "in this process (the first tpu tensor or JAX computation creates them): call "
            "hf_tpu.distributed.initialize() before any, or set HF_TPU_COORDINATOR_ADDRESS, "
            "HF_TPU_NUM_PROCESSES and HF_TPU_PROCESS_ID before `import hf_tpu`, which then joins the run first"
        )
    if "JAX_CPU_COLLECTIVES_IMPLEMENTATION" not in os.environ:
        # collectives between processes' CPU devices (the simulated chips); gloo ships with jaxlib
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(settings["coordinator_address"], settings["num_processes"], settings["process_id"])


if any(_settings.get(variable) is not None for variable in _DISTRIBUTED_VARIABLES.values()):
    initialize_distributed()


@functools.cache
def name() -> str:
    """The JAX platform behind `tpu`: 'tpu', 'gpu' or 'cpu'."""
    wanted = _settings.get("HF_TPU_PLATFORM")
    if wanted:
        wanted = _PLATFORM_ALIASES[wanted]
        try:
            jax.devices(wanted)
        except RuntimeError as e:
            raise RuntimeError(
                f"HF_TPU_PLATFORM={wanted} but JAX finds no {wanted} devices ({e}). "
                "Unset HF_TPU_PLATFORM to use JAX's default backend."
            ) from None
        return wanted
    backend = jax.default_backend()
    return "gpu" if backend in ("cuda", "rocm") else backend


@functools.cache
def devices() -> tuple:
    """The JAX devices that are `tpu:0`, `tpu:1`, ... in this process."""
    return tuple(jax.local_devices(backend=name()))


def device_count() -> int:
    return len(devices())


@functools.cache
def global_devices() -> tuple:
    """The chips of every process of a multi-process run, process by process (`devices()` in one process)."""
    return tuple(jax.devices(name()))


def jax_device(index: int):
    """The JAX device for `tpu:index`, with PyTorch's error for an index that does not exist."""
    devs = devices()
    if not 0 <= index < len(devs):
        raise RuntimeError(
            f"Invalid device tpu:{index}: this process has {len(devs)} tpu device(s) "
            f"(platform {name()}). On the CPU, HF_TPU_NUM_DEVICES=N simulates N chips."
        )
    return devs[index]


def memory_info(index: int) -> tuple[int, int]:
    """(free, total) bytes of device `index`; on the CPU platform, of the host."""
    dev = jax_device(index)
    stats = None
    try:
        stats = dev.memory_stats()
    except Exception:
        stats = None
    if stats and "bytes_limit" in stats:
        total = int(stats["bytes_limit"])
        return total - int(stats.get("bytes_in_use", 0)), total
    page = os.sysconf("SC_PAGE_SIZE")
    total = os.sysconf("SC_PHYS_PAGES") * page
    free = os.sysconf("SC_AVPHYS_PAGES") * page
    return free, total


def supports_float64() -> bool:
    """TPUs have no float64 arithmetic; XLA on CPU and GPU does."""
    return name() != "tpu"
