"""`torch.tpu`: the device module PyTorch and its users call, as `torch.cuda` is for CUDA.

`import hf_tpu` registers this module as `torch.tpu` and names PyTorch's PrivateUse1 backend `tpu`.
Device indices, streams and RNG are kept here in Python: PyTorch's Python backend hooks expose no
device switching, so `set_device` and `device(...)` steer our own current-device index, which every
factory call without an explicit index uses.
"""

from __future__ import annotations

import contextlib
import dataclasses
import sys
import time

import jax
import torch

from .. import modes, platform
from ..device_state import current, rng
from ..memory import buffer, host_transfers


def _index(device=None) -> int:
    if device is None:
        return current.current_device_index()
    if isinstance(device, int):
        platform.jax_device(device)
        return device
    device = torch.device(device)
    if device.type != "tpu":
        raise ValueError(f"Expected a tpu device, got {device}")
    return current.current_index_for(device)


# --- Availability and devices


def is_available() -> bool:
    return platform.device_count() > 0


def is_initialized() -> bool:
    """Whether the devices are in use (JAX's backend is up), as `torch.cuda` initialises on first use.
    PyTorch saves and restores only an initialised device's random state around a recomputation
    (`torch.utils.checkpoint` reads `torch.<device>._initialized`): a flag that only `init()` set left
    a checkpointed dropout drawing new masks in backward, so its gradients were wrong."""
    return platform.devices.cache_info().currsize > 0


def init() -> None:
    platform.devices()


def __getattr__(name: str):
    if name == "_initialized":  # what PyTorch reads of a device module
        return is_initialized()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _is_in_bad_fork() -> bool:
    return False


def device_count() -> int:
    return platform.device_count()


def current_device() -> int:
    return current.current_device_index()


def set_device(device) -> None:
    current.set_current_device_index(_index(device))


class device:
    """Context manager that makes `device` the current tpu device."""

    def __init__(self, device):
        self.index = _index(device) if device is not None else None
        self.previous = None

    def __enter__(self):
        self.previous = current_device()
        if self.index is not None:
            set_device(self.index)
        return self

    def __exit__(self, *exc):
        set_device(self.previous)
        return False


def get_device_name(device=None) -> str:
    dev = platform.jax_device(_index(device))
    kind = getattr(dev, "device_kind", platform.name())
    if platform.name() == "cpu":
        return f"virtual TPU (JAX {kind})"
    return kind


@dataclasses.dataclass(frozen=True)
class DeviceProperties:
    name: str
    platform: str
    index: int
    total_memory: int
    jax_device: str


def get_device_properties(device=None) -> DeviceProperties:
    index = _index(device)
    free, total = mem_get_info(index)
    return DeviceProperties(
        name=get_device_name(index),
        platform=platform.name(),
        index=index,
        total_memory=total,
        jax_device=str(platform.jax_device(index)),
    )


def get_amp_supported_dtype() -> list:
    return [torch.bfloat16, torch.float16]


def supported_dtypes() -> list:
    """The dtypes tpu tensors can hold on this platform (float64 only where XLA computes it)."""
    dts = [torch.float32, torch.bfloat16, torch.float16, torch.int8, torch.int16, torch.int32,
           torch.int64, torch.uint8, torch.bool, torch.complex64]
    return dts + ([torch.float64, torch.complex128] if platform.supports_float64() else [])


def is_bf16_supported(including_emulation: bool = True) -> bool:
    return True


def synchronize(device=None) -> None:
    """Wait until every computation on the device has finished (and flush deferred work)."""
    modes.current().sync("torch.tpu.synchronize()")
    index = _index(device)
    jax.block_until_ready(buffer.device_arrays(index))
    modes.report_device_checks()


# --- RNG


def manual_seed(seed: int) -> None:
    rng.manual_seed(int(seed), current_device())


def manual_seed_all(seed: int) -> None:
    rng.manual_seed_all(int(seed))


def seed() -> None:
    rng.manual_seed(rng.random_seed(), current_device())


def seed_all() -> None:
    rng.manual_seed_all(rng.random_seed())


def initial_seed() -> int:
    return rng.initial_seed(current_device())


def get_rng_state(device="tpu") -> torch.Tensor:
    mode = modes.current()
    if mode.kind is modes.ModeKind.TRACE:  # inside a traced program: the state at its next random op
        return mode.rng_state(_index(device))
    return rng.get_state(_index(device))


def set_rng_state(new_state: torch.Tensor, device="tpu") -> None:
    mode = modes.current()
    if mode.kind is modes.ModeKind.TRACE:
        return mode.set_rng_state(new_state, _index(device))
    rng.set_state(new_state, _index(device))


def get_rng_state_all() -> list:
    return [rng.get_state(i) for i in range(device_count())]


def set_rng_state_all(new_states) -> None:
    for i, state in enumerate(new_states):
        rng.set_state(state, i)


# --- Memory


def memory_allocated(device=None) -> int:
    """Bytes held by live tpu tensors on the device."""
    return buffer.allocator.allocated.get(_index(device), 0)


def max_memory_allocated(device=None) -> int:
    return buffer.allocator.peak.get(_index(device), 0)


def memory_reserved(device=None) -> int:
    return memory_allocated(device)


def max_memory_reserved(device=None) -> int:
    return max_memory_allocated(device)


def reset_peak_memory_stats(device=None) -> None:
    index = _index(device)
    buffer.allocator.peak[index] = buffer.allocator.allocated.get(index, 0)


def reset_max_memory_allocated(device=None) -> None:
    reset_peak_memory_stats(device)


def memory_stats(device=None) -> dict:
    """The counters of `torch.cuda.memory_stats` that apply here."""
    index = _index(device)
    current = memory_allocated(index)
    peak = max_memory_allocated(index)
    allocs = buffer.allocator.num_allocs.get(index, 0)
    live = len(buffer.live_buffers(index))
    stats = {}
    for pool in ("all", "large_pool", "small_pool"):
        used = current if pool != "small_pool" else 0
        top = peak if pool != "small_pool" else 0
        for kind in ("allocated_bytes", "reserved_bytes", "active_bytes", "requested_bytes"):
            stats[f"{kind}.{pool}.current"] = used
            stats[f"{kind}.{pool}.peak"] = top
        stats[f"allocation.{pool}.current"] = live if pool != "small_pool" else 0
        stats[f"allocation.{pool}.allocated"] = allocs if pool != "small_pool" else 0
    stats["num_alloc_retries"] = 0
    stats["num_ooms"] = 0
    return stats


def memory_summary(device=None, abbreviated: bool = False) -> str:
    stats = memory_stats(device)
    return (
        f"tpu:{_index(device)} allocated {stats['allocated_bytes.all.current']} bytes, "
        f"peak {stats['allocated_bytes.all.peak']} bytes"
    )


def empty_cache() -> None:
    """Lets go of the tiny host values kept once uploaded; JAX frees every other buffer as soon as its
    last tensor dies."""
    host_transfers.let_go_of_kept_uploads()


def mem_get_info(device=None) -> tuple[int, int]:
    """(free, total) bytes of the device; on the CPU platform, of the host."""
    return platform.memory_info(_index(device))


# --- Streams and events: JAX orders work per device itself, so there is one stream per device.


class Stream:
    def __init__(self, device=None, priority: int = 0, **kwargs):
        self.device_index = _index(device)
        self.device = torch.device("tpu", self.device_index)
        self.priority = priority

    def synchronize(self) -> None:
        synchronize(self.device_index)

    def query(self) -> bool:
        synchronize(self.device_index)
        return True

    def wait_stream(self, stream) -> None:
        """Work on one device runs in order already."""

    def wait_event(self, event) -> None:
        event.synchronize()

    def record_event(self, event=None):
        event = event or Event()
        event.record(self)
        return event

    def __eq__(self, other):
        return isinstance(other, Stream) and other.device_index == self.device_index

    def __hash__(self):
        return hash(("tpu-stream", self.device_index))

    def __repr__(self):
        return f"<torch.tpu.Stream device=tpu:{self.device_index}>"


class Event:
    def __init__(self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False):
        self.enable_timing = enable_timing
        self.time = None
        self.stream = None

    def record(self, stream=None) -> None:
        self.stream = stream or current_stream()
        self.stream.synchronize()
        self.time = time.perf_counter()

    def synchronize(self) -> None:
        if self.stream is not None:
            self.stream.synchronize()

    def wait(self, stream=None) -> None:
        self.synchronize()

    def query(self) -> bool:
        return True

    def elapsed_time(self, end_event) -> float:
        """Milliseconds between this event and `end_event`."""
        if not (self.enable_timing and end_event.enable_timing):
            raise RuntimeError("Events must be created with enable_timing=True to measure elapsed time")
        if self.time is None or end_event.time is None:
            raise RuntimeError("Both events must be recorded before calling elapsed_time()")
        return (end_event.time - self.time) * 1000.0


def current_stream(device=None) -> Stream:
    return Stream(device)


def default_stream(device=None) -> Stream:
    return Stream(device)


def set_stream(stream: Stream) -> None:
    set_device(stream.device_index)


@contextlib.contextmanager
def stream(stream: Stream | None):
    if stream is None:
        yield
        return
    with device(stream.device_index):
        yield


# --- Execution modes: `torch.tpu.EagerMode`, `set_eager_mode`, the `eager_mode` property and a
# context manager. See docs/design/execution-modes.md.

from ..modes import EagerMode, set_eager_mode  # noqa: E402,F401
from ..modes import eager_mode as use_eager_mode  # noqa: E402,F401


class _TpuModule(sys.modules[__name__].__class__):
    @property
    def eager_mode(self) -> EagerMode:
        return modes.get_eager_mode()

    @eager_mode.setter
    def eager_mode(self, mode) -> None:
        set_eager_mode(mode)


sys.modules[__name__].__class__ = _TpuModule
