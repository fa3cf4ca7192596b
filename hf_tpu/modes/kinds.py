"""The execution modes by name: `EagerMode`, the three a user picks, and `ModeKind`, what a mode object
is (`mode.kind`): one of those, or a `torch.compile` trace (`hf_tpu.compile`)."""

from __future__ import annotations

import enum


class EagerMode(enum.Enum):
    DEFER_NEVER = "DEFER_NEVER"
    DEFER_AND_FUSE = "DEFER_AND_FUSE"
    DEFER_NEVER_AND_LAUNCH_BLOCKING = "DEFER_NEVER_AND_LAUNCH_BLOCKING"


class ModeKind(enum.Enum):
    """Every mode object's `kind`; its value is the mode's key in the per-mode metrics
    (`compiles_by_mode`, `compile_cache_hits_by_mode`)."""

    DEFER_NEVER = "DEFER_NEVER"
    DEFER_AND_FUSE = "DEFER_AND_FUSE"
    DEFER_NEVER_AND_LAUNCH_BLOCKING = "DEFER_NEVER_AND_LAUNCH_BLOCKING"
    TRACE = "TRACE"
