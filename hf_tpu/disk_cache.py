"""A traced call's program loaded from the disk cache (`HF_TPU_CACHE_DIR`) while the call traces.

JAX finds a program in its disk cache by a key it hashes from the lowered program, so a process must trace and
lower a call before it can look, and only then reads the executable and deserialises it. For a large program the
deserialisation takes longer than the trace: on a TPU v5e, the 1.1B Llama's prefill (an executable of 40 MB,
2.4 MB compressed) took 1.9 s to deserialise after about 1.2 s of Python trace and lowering, in a second process's
first token of 3.2 s. Deserialising runs no Python (JAX releases the GIL for it), so it can run beside the trace,
once something names the key before the trace does.

That name is written by the process before. An `hf_tpu.jit` call's key, as text that is the same in every process
(`hf_tpu.direct`: its code, the shapes, dtypes and plain values it is keyed by), becomes a digest (`expect`), and the
first compile of the call's program writes, as `HF_TPU_CACHE_DIR/prefetch/<digest>.json`, the JAX key it found
or wrote the executable under, with the compile options it was built with. At a later process's first trace of
an equal call, that executable is read and deserialised on a thread; when JAX then asks its disk cache for a key
(`jax._src.compiler._cache_read`), the call's program gets the loaded executable if JAX's key is the one named.
The key JAX computed is the check: a stale or wrong name costs a load that is thrown away, never another
program.

The write is the other half: JAX serialises, compresses and writes a program it compiled before the call that
compiled it may run it, and a large program takes seconds to write (the 1.1B Llama's checkpointed training step is
345 MB of TPU program). The write is handed to a thread (`_cache_write`); the call runs meanwhile, and the
process waits for the writes at exit (the pool's thread is joined then), so the next process finds them. Only the
compression (zstandard, a dependency: about 8x zlib's speed) and the file's write run beside the call's Python:
JAX's serialisation of the executable holds the GIL (on the v5e several seconds of that training step's first).
Where the disk cache is off, nothing here runs.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import hashlib
import json
import logging
import os
import threading

import jax
import torch

from . import platform
from .counters import counters

log = logging.getLogger("hf_tpu.compile")

_FOLDER = "prefetch"
_PENDING_MOST = 8  # loads kept for calls that have not compiled yet (a call that fell back never takes its own)

_local = threading.local()  # .digest: the call whose program this thread compiles, named by `compiling`
_lock = threading.Lock()
_pending: dict = {}  # digest -> (JAX key, device id, future of (executable, compile time) or None)
_written: dict = {}  # digest -> the entry on disk, as read or last written by this process
_loader: concurrent.futures.ThreadPoolExecutor | None = None
_writer: concurrent.futures.ThreadPoolExecutor | None = None
_jax_read = None  # JAX's `compiler._cache_read`, wrapped by `_cache_read`
_jax_write = None  # JAX's `compiler._cache_write`, wrapped by `_cache_write`


def enabled() -> bool:
    """Whether programs are kept on disk (`HF_TPU_CACHE_DIR`) and JAX's read of them can be given a loaded one."""
    return bool(platform.cache_dir()) and _hook_jax()


def expect(key_text: str, device_index: int) -> str:
    """The digest of a call about to be traced for the first time in this process, from its key as text that is the
    same in every process (`hf_tpu.direct`), with the load of its program started where an earlier process named
    one. Only where `enabled()`."""
    device = platform.jax_device(device_index)
    digest = _digest(key_text, device)
    entry = _read_entry(platform.cache_dir(), digest)
    if entry is not None:
        _start_load(digest, entry, device)
    return digest


def compiling(digest: str | None):
    """Within it, JAX's disk-cache lookups on this thread are the program of the call `digest` names: the one a
    first launch compiles, or a compile on a thread of its own. Nothing for None."""
    return contextlib.nullcontext() if digest is None else _Compiling(digest)


class _Compiling:
    __slots__ = ("digest", "outer")

    def __init__(self, digest: str):
        self.digest = digest

    def __enter__(self):
        self.outer = getattr(_local, "digest", None)
        _local.digest = self.digest

    def __exit__(self, *exc):
        _local.digest = self.outer


def _digest(key_text: str, device) -> str:
    """The name of a program in the prefetch entries: its call's key, on this platform and device kind, with these
    JAX and PyTorch releases (the JAX key checks the rest)."""
    text = "\x1f".join([device.platform, device.device_kind, jax.__version__, torch.__version__, key_text])
    return hashlib.blake2b(text.encode(), digest_size=16).hexdigest()


def _path(folder: str, digest: str) -> str:
    return os.path.join(folder, _FOLDER, f"{digest}.json")


def _read_entry(folder: str, digest: str) -> dict | None:
    try:
        with open(_path(folder, digest)) as f:
            entry = json.load(f)
        entry = {"key": str(entry["key"]), "options": str(entry["options"])}
    except (OSError, ValueError, KeyError, TypeError):  # none yet, or one not written by this module
        return None
    _written[digest] = entry
    return entry


def _write_entry(digest: str, cache_key: str, compile_options) -> None:
    folder = platform.cache_dir()
    entry = {"key": cache_key, "options": compile_options.SerializeAsString().hex()}
    if not folder or _written.get(digest) == entry:
        return
    path = _path(folder, digest)
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        partial = f"{path}.{os.getpid()}.{threading.get_ident()}"
        with open(partial, "w") as f:
            json.dump(entry, f)
        os.replace(partial, path)  # whole or not at all, for a process reading it meanwhile
    except OSError as e:
        log.info("hf_tpu: the disk cache's prefetch entry %s was not written (%s)", path, e)
        return
    _written[digest] = entry


def _start_load(digest: str, entry: dict, device) -> None:
    global _loader
    with _lock:
        if _loader is None:  # two: the decode loop's program and the prefill's load side by side
            _loader = concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="hf_tpu disk cache")
        future = _loader.submit(_load, entry["key"], bytes.fromhex(entry["options"]), device)
        _pending[digest] = (entry["key"], device.id, future)
        while len(_pending) > _PENDING_MOST:
            del _pending[next(iter(_pending))]


def _load(cache_key: str, options: bytes, device):
    """(executable, compile time) as JAX's `compilation_cache.get_executable_and_time` reads it, or None."""
    from jax._src import compilation_cache
    from jax._src.lib import xla_client

    backend = device.client
    if not compilation_cache.is_cache_used(backend):
        return None
    cache = compilation_cache._get_cache(backend)
    data = None if cache is None else cache.get(cache_key)
    if data is None:
        return None
    serialized, compile_time = compilation_cache.extract_executable_and_time(
        compilation_cache.decompress_executable(data))
    executable = backend.deserialize_executable(serialized, xla_client.DeviceList((device,)),
                                                xla_client.CompileOptions.ParseFromString(options))
    return executable, compile_time


def _forget_threads_in_child() -> None:
    """A forked child has none of its parent's threads: a pool whose threads are gone would never run its loads, and
    a load waited for would never end. The child starts its own pool, with a lock no parent thread may hold."""
    global _loader, _writer, _lock
    _loader, _writer, _lock = None, None, threading.Lock()
    _pending.clear()


os.register_at_fork(after_in_child=_forget_threads_in_child)


def _hook_jax() -> bool:
    """Wrap JAX's disk-cache read and write once; False with another JAX, whose internals differ (nothing is loaded
    ahead, and JAX writes as it does)."""
    global _jax_read, _jax_write
    with _lock:
        if _jax_read is None:
            from jax._src import compiler

            if not (callable(getattr(compiler, "_cache_read", None))
                    and callable(getattr(compiler, "_cache_write", None))):
                return False
            _jax_read, _jax_write = compiler._cache_read, compiler._cache_write
            compiler._cache_read, compiler._cache_write = _cache_read, _cache_write
    return True


def _cache_write(cache_key, compile_time_secs, module_name, backend, executable, host_callbacks) -> None:
    """JAX's disk-cache write of a program it just compiled, on a thread of its own: one at a time, in the order
    compiled. JAX's write reports its own errors (as warnings); anything else it raises is logged."""
    global _writer
    with _lock:
        if _writer is None:
            _writer = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="hf_tpu disk cache write")
        written = _writer.submit(_jax_write, cache_key, compile_time_secs, module_name, backend, executable,
                                 host_callbacks)
    written.add_done_callback(lambda future: future.exception() is None or log.warning(
        "hf_tpu: %s was not written to the disk cache (%s: %s)", module_name, type(future.exception()).__name__,
        future.exception()))


def _cache_read(module_name, cache_key, compile_options, backend, executable_devices):
    """JAX's disk-cache read, given the executable loaded ahead for the program this thread compiles when JAX's
    key is the one that load was named by; and the key noted for the next process."""
    digest = getattr(_local, "digest", None)
    if digest is None:
        return _jax_read(module_name, cache_key, compile_options, backend, executable_devices)
    with _lock:
        pending = _pending.pop(digest, None)
    devices = [device.id for device in executable_devices]
    loaded = None
    if pending is not None and pending[0] == cache_key and [pending[1]] == devices:
        try:
            loaded = pending[2].result()
        except Exception as e:  # noqa: BLE001 - JAX's own read below reports what is wrong with the entry
            log.info("hf_tpu: loading %s from the disk cache ahead failed (%s: %s)", module_name, type(e).__name__, e)
    if loaded is None:
        loaded = _jax_read(module_name, cache_key, compile_options, backend, executable_devices)
    else:
        counters["disk_cache_prefetched"] += 1
    if len(devices) == 1:  # a program over several chips is not loaded ahead (`_load` places it on one)
        _write_entry(digest, cache_key, compile_options)
    return loaded


if platform.cache_dir():
    _hook_jax()
