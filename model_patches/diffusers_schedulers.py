"""Diffusers' schedulers keep their schedule on the host: a host sync removed from every denoising step.

A scheduler asked for `set_timesteps(..., device=tpu)` builds its timesteps and sigmas on the CPU instead.
Its per-step bookkeeping (indexing the schedule with the current timestep, `prev_timestep >= 0`, finding
the step index) then reads host memory: on `tpu` each of those was a device-to-host read, several per step
(DDIM) or one per call (Euler, DPM-Solver). The values are the ones the CPU computes, so results do not
change; the scalars join the `tpu` latents as CPU scalar tensors, which are traced arguments, never
compiled in. The Diffusers adapter calls `patch_scheduler_class(cls)` for every scheduler class.
"""

from __future__ import annotations

import functools
import inspect

from hf_tpu.wrapping import is_tpu, wrap_once


def _wrap_set_timesteps(original):
    signature = inspect.signature(original)

    @functools.wraps(original)
    def set_timesteps(self, *args, **kwargs):
        """On `tpu`, the schedule is built on the host: the loop's bookkeeping reads it every step."""
        bound = signature.bind(self, *args, **kwargs)
        if is_tpu(bound.arguments.get("device")):
            bound.arguments["device"] = "cpu"
        return original(*bound.args, **bound.kwargs)

    return set_timesteps


def patch_scheduler_class(cls) -> None:
    """Wraps the `set_timesteps` that `cls` defines itself, once; a scheduler whose schedule never goes to a
    device is left as it is."""
    own = cls.__dict__.get("set_timesteps")
    if own is not None and "device" in inspect.signature(own).parameters:
        wrap_once(cls, "set_timesteps", _wrap_set_timesteps)
