"""The denoisers of a Diffusers pipeline on `tpu` take the scheduler's host-side timestep onto their chip.

With the schedule on the host (`diffusers_schedulers`), the loop hands each denoiser a host tensor as its
`timestep`: a forward pre-hook uploads it to the chip the denoiser's weights are on (an upload per step,
not a sync), so a compiled forward always sees a `tpu` tensor, never a Python number it would specialise
on. The Diffusers adapter calls `patch_pipeline(pipe)` when a pipeline runs on `tpu`.
"""

from __future__ import annotations

import inspect

import torch

# the pipeline components that take a `timestep` at every denoising step
DENOISERS = ("unet", "transformer", "prior", "controlnet")

_TIMESTEP_HOOK = "_hf_tpu_timestep_hook"


def denoisers(pipe):
    """The pipeline's denoising models, in the order of `DENOISERS`."""
    for name in DENOISERS:
        module = getattr(pipe, name, None)
        if isinstance(module, torch.nn.Module):
            yield module


def _timestep_to_device(module, args, kwargs):
    """The scheduler's host-side timestep goes where the model runs (an upload, not a sync): the chip
    its weights are on now, since a pipeline may have moved (`pipe.to("cpu")`, `pipe.to("tpu:1")`)."""
    position = module._hf_tpu_timestep_position
    weight = next(module.parameters(), None)
    if weight is None or weight.device.type != "tpu":
        return args, kwargs
    device = weight.device
    if "timestep" in kwargs:
        timestep = kwargs["timestep"]
        if isinstance(timestep, torch.Tensor) and timestep.device.type == "cpu":
            kwargs["timestep"] = timestep.to(device)
    elif len(args) > position:
        timestep = args[position]
        if isinstance(timestep, torch.Tensor) and timestep.device.type == "cpu":
            args = args[:position] + (timestep.to(device),) + args[position + 1:]
    return args, kwargs


def patch_pipeline(pipe) -> None:
    """Each denoiser of a pipeline that runs on `tpu` takes the scheduler's host-side timestep onto its
    chip; once per model."""
    for module in denoisers(pipe):
        if getattr(module, _TIMESTEP_HOOK, None) is not None:
            continue
        # `torch.compile(pipe.transformer)` is an `OptimizedModule`, whose forward takes anything: the signature is
        # the module's it compiled (the hook, on the `OptimizedModule`, runs before its compiled call)
        parameters = list(inspect.signature(getattr(module, "_orig_mod", module).forward).parameters)
        if "timestep" not in parameters:
            continue
        module._hf_tpu_timestep_position = parameters.index("timestep")
        setattr(module, _TIMESTEP_HOOK, module.register_forward_pre_hook(_timestep_to_device, with_kwargs=True))
