"""Process-wide counters that tests, benchmarks and users read to see what the backend did."""

from __future__ import annotations

import collections
import copy

_COUNTERS = ("ops_dispatched", "compiles", "compile_cache_hits", "host_syncs", "xla_compiles", "disk_cache_hits",
             "disk_cache_prefetched", "programs_launched", "argument_bytes")

counters: dict = {}


def reset_metrics() -> None:
    """Zero every counter."""
    counters.clear()
    counters.update({name: 0 for name in _COUNTERS})
    counters["cpu_fallbacks"] = collections.Counter()
    counters["compiles_by_mode"] = collections.Counter()
    counters["compile_cache_hits_by_mode"] = collections.Counter()
    counters["flushes_by_reason"] = collections.Counter()


def metrics() -> dict:
    """A snapshot of the counters: ops_dispatched, compiles (programs traced), compile_cache_hits,
    host_syncs, cpu_fallbacks (per op name), the compile counts per execution mode, xla_compiles
    (XLA backend compilations), disk_cache_hits (executables loaded from HF_TPU_CACHE_DIR), disk_cache_prefetched
    (those of them loaded while the `hf_tpu.jit` call that needed them traced: `hf_tpu.disk_cache`),
    programs_launched and argument_bytes (traced programs run: `hf_tpu.jit`'s, the direct trace's, each chunk of a
    device loop; and the bytes of their argument arrays, which a program reads at most) and
    flushes_by_reason (DEFER_AND_FUSE: the fused programs launched, by what made each run: a cut point,
    a host read, ...)."""
    snap = copy.deepcopy(counters)
    for key in ("cpu_fallbacks", "compiles_by_mode", "compile_cache_hits_by_mode", "flushes_by_reason"):
        snap[key] = dict(snap[key])
    return snap


reset_metrics()


def _on_jax_event(event: str, *args, **kwargs) -> None:
    if event == "/jax/compilation_cache/cache_hits":
        counters["disk_cache_hits"] += 1
        counters["xla_compiles"] -= 1  # counted as a backend compile below, but nothing compiled


def _on_jax_duration(event: str, duration: float, *args, **kwargs) -> None:
    if event == "/jax/core/compile/backend_compile_duration":
        counters["xla_compiles"] += 1


def _listen_to_jax() -> None:
    from jax._src import monitoring

    monitoring.register_event_listener(_on_jax_event)
    monitoring.register_event_duration_secs_listener(_on_jax_duration)


_listen_to_jax()
