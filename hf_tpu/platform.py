"""Which JAX devices back `tpu`, chosen once per process.

JAX picks the hardware: a TPU through libtpu, else a GPU, else the host CPU (a "virtual TPU").
`HF_TPU_PLATFORM=cpu|gpu|tpu` overrides the choice and `HF_TPU_NUM_DEVICES=N` simulates N chips on
the CPU. Both must be read before JAX creates its backends, so this module is imported first.
"""

from __future__ import annotations

import functools
import os

_PLATFORM_ALIASES = {"cpu": "cpu", "gpu": "gpu", "cuda": "gpu", "rocm": "gpu", "tpu": "tpu"}


def _configure_jax_before_backends() -> None:
    num = os.environ.get("HF_TPU_NUM_DEVICES")
    if num:
        flag = f"--xla_force_host_platform_device_count={int(num)}"
        flags = os.environ.get("XLA_FLAGS", "")
        if "xla_force_host_platform_device_count" not in flags:
            os.environ["XLA_FLAGS"] = f"{flags} {flag}".strip()


_configure_jax_before_backends()

import jax  # noqa: E402

# PyTorch's default integer type is int64 and float64 is a real dtype there; without x64 JAX would
# silently compute them in 32 bits.
jax.config.update("jax_enable_x64", True)


def cache_dir() -> str:
    """Where compiled programs persist between processes (`HF_TPU_CACHE_DIR`, empty to disable)."""
    return os.environ.get("HF_TPU_CACHE_DIR", os.path.join(os.path.expanduser("~"), ".cache", "hf_tpu"))


if cache_dir():
    # XLA executables are cached on disk by JAX, keyed by the program and the compiler/platform, so
    # a second process starts warm; an unreadable entry is recompiled.
    jax.config.update("jax_compilation_cache_dir", os.path.join(cache_dir(), "xla"))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
if os.environ.get("HF_TPU_NUM_DEVICES"):
    try:
        jax.config.update("jax_num_cpu_devices", int(os.environ["HF_TPU_NUM_DEVICES"]))
    except Exception:  # backends already initialised by the user: the XLA flag above applies
        pass


@functools.cache
def name() -> str:
    """The JAX platform behind `tpu`: 'tpu', 'gpu' or 'cpu'."""
    wanted = os.environ.get("HF_TPU_PLATFORM", "").strip().lower()
    if wanted:
        if wanted not in _PLATFORM_ALIASES:
            raise ValueError(f"HF_TPU_PLATFORM={wanted!r}: expected one of cpu, gpu, tpu")
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


def jax_device(index: int):
    """The JAX device for `tpu:index`, with PyTorch's error for an index that does not exist."""
    devs = devices()
    if not 0 <= index < len(devs):
        raise RuntimeError(
            f"Invalid device tpu:{index}: this process has {len(devs)} tpu device(s) "
            f"(platform {name()}). On the CPU, HF_TPU_NUM_DEVICES=N simulates N chips."
        )
    return devs[index]


def supports_float64() -> bool:
    """TPUs have no float64 arithmetic; XLA on CPU and GPU does."""
    return name() != "tpu"
