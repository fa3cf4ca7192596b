"""Process-wide counters that tests, benchmarks and users read to see what the backend did."""

from __future__ import annotations

import collections
import copy

_COUNTERS = ("ops_dispatched", "compiles", "compile_cache_hits", "host_syncs")

counters: dict = {}


def reset_metrics() -> None:
    """Zero every counter."""
    counters.clear()
    counters.update({name: 0 for name in _COUNTERS})
    counters["cpu_fallbacks"] = collections.Counter()
    counters["compiles_by_mode"] = collections.Counter()
    counters["compile_cache_hits_by_mode"] = collections.Counter()


def metrics() -> dict:
    """A snapshot of the counters: ops_dispatched, compiles, compile_cache_hits, host_syncs,
    cpu_fallbacks (per op name) and the compile counts per execution mode."""
    snap = copy.deepcopy(counters)
    for key in ("cpu_fallbacks", "compiles_by_mode", "compile_cache_hits_by_mode"):
        snap[key] = dict(snap[key])
    return snap


reset_metrics()
