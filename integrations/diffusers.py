"""The Diffusers adapter: pipelines on `tpu` with `pipe.to("tpu")`, a denoising loop with no host
round-trip per step, and `compile_pipeline(pipe)` for the heavy models.

Installed by `hf_tpu.integrations.activate()` when a Diffusers module below is first imported. What it
changes, only where `tpu` is involved:

- The host syncs of the denoising loop are removed by patches in `hf_tpu.model_patches`: every scheduler
  class keeps its schedule on the host (`model_patches.patch_scheduler_class`, see
  `model_patches/diffusers_schedulers.py`), and the denoisers of a pipeline that runs on `tpu` upload the
  host-side timestep the loop hands them (`model_patches.patch_pipeline`, see
  `model_patches/diffusers_denoisers.py`). This adapter decides when: for every scheduler class, and
  for a pipeline when it asks where it runs.
- `diffusers.utils.testing_utils`' `BACKEND_*` tables get `tpu` entries backed by `torch.tpu`, so test
  code run with `DIFFUSERS_TEST_DEVICE=tpu DIFFUSERS_TEST_BACKEND=hf_tpu` seeds, synchronises and
  counts devices on `tpu` (Diffusers' "default" entries would seed the CPU and report 0 devices).
"""

from __future__ import annotations

import functools
import sys

import torch

from hf_tpu import model_patches
from hf_tpu.model_patches import DENOISERS
from hf_tpu.wrapping import is_tpu, module_on_tpu, original_of, wrap_once

from .output_capturing import install_output_capturing_hooks

TEXT_ENCODERS = ("text_encoder", "text_encoder_2", "text_encoder_3")


# --- Schedulers


def _all_subclasses(cls):
    for subclass in cls.__subclasses__():
        yield subclass
        yield from _all_subclasses(subclass)


def _install_schedulers(scheduling_utils) -> None:
    """Every scheduler class, those defined already and those defined later (Diffusers imports its
    scheduler modules lazily, each after `scheduling_utils`)."""
    mixin = scheduling_utils.SchedulerMixin
    if "__init_subclass__" in mixin.__dict__:
        return  # installed already (Diffusers' SchedulerMixin defines none)

    @classmethod
    def __init_subclass__(cls, **kwargs):
        super(mixin, cls).__init_subclass__(**kwargs)
        model_patches.patch_scheduler_class(cls)

    mixin.__init_subclass__ = __init_subclass__
    for cls in _all_subclasses(mixin):
        model_patches.patch_scheduler_class(cls)


# --- Pipelines


def _modules(pipe, names):
    for name in names:
        module = getattr(pipe, name, None)
        if isinstance(module, torch.nn.Module):
            yield name, module


def prepare_pipeline(pipe) -> None:
    """Each denoiser of a pipeline that runs on `tpu` takes the scheduler's host-side timestep onto its
    chip (`model_patches.patch_pipeline`); once per model."""
    model_patches.patch_pipeline(pipe)


def _wrap_execution_device(original):
    """A pipeline asks where it runs at the start of every call: then its denoisers get prepared, however
    they reached `tpu` (`pipe.to`, `device_map="tpu"`, a component swapped in)."""

    @functools.wraps(original)
    def _execution_device(self):
        device = original(self)
        if is_tpu(device):
            prepare_pipeline(self)
        return device

    return _execution_device


def compile_pipeline(pipe, *, vae_decoder: bool = True, text_encoders: bool = True, dynamic: bool = False,
                     options: dict | None = None):
    """Compiles the pipeline's denoiser (`unet`, `transformer`, ...) and, with `vae_decoder` and
    `text_encoders`, the VAE's decoder and the text encoders with `torch.compile(backend="tpu")`. The
    pipeline must be on `tpu` already. Prompts are padded to the tokenizer's maximum length, so the text
    encoders compile once; with classifier-free guidance they run twice per call and each eager run costs
    hundreds of op launches.

    Each model's `forward` is compiled, not its `__call__`, so the forward hooks (the timestep upload
    among them) run before it and the compiled graph only ever sees `tpu` tensors. With
    `dynamic=False`, a new resolution or batch size compiles its own graph once; repeating one compiles
    nothing. Each call is traced straight from Python (`hf_tpu.compiled_modules`), Dynamo compiling what that
    trace cannot take. `options` is passed to each `torch.compile`, for where Dynamo compiles (everywhere with
    HF_TPU_COMPILE_DIRECT=0): `{"guard_filter_fn": torch.compiler.skip_guard_on_all_nn_modules_unsafe}` drops
    Dynamo's checks of module attributes before every call (about a tenth of a compiled tiny SD3 image there),
    only for models that do not change afterwards and that differ from each other in their tensors' shapes:
    after `load_lora_weights`, `.train()` or a new hook a model would run its old graph, and two models of one
    class differing only in a non-tensor setting would share one. Returns `pipe`.
    """
    targets = list(_modules(pipe, DENOISERS))
    if text_encoders:
        targets += _modules(pipe, TEXT_ENCODERS)
    if vae_decoder and getattr(getattr(pipe, "vae", None), "decoder", None) is not None:
        targets.append(("vae.decoder", pipe.vae.decoder))
    if not targets:
        raise ValueError(f"{type(pipe).__name__} has none of {DENOISERS} and no VAE decoder to compile.")
    for name, module in targets:
        if not module_on_tpu(module):
            raise ValueError(f"pipe.{name} is on {next(module.parameters()).device}: call pipe.to('tpu') before "
                             "compile_pipeline(pipe).")
    prepare_pipeline(pipe)
    for _, module in targets:
        if original_of(module.forward) is None:
            install_output_capturing_hooks(module)
            # a copy each: torch.compile pops what Dynamo reads (the guard filter) out of the dict it is given
            wrap_once(module, "forward", lambda forward: torch.compile(
                forward, backend="tpu", dynamic=dynamic, options=None if options is None else dict(options)))
    return pipe


# --- Tensor parallelism: `from_pretrained(..., parallel_config=TensorParallelConfig(tp_degree=N))`


def _tensor_parallel_config(parallel_config):
    """The TensorParallelConfig in `parallel_config` (alone or inside a ParallelConfig), or None."""
    return getattr(parallel_config, "tensor_parallel_config", parallel_config) if parallel_config is not None else None


def _shards_on_tpu(kwargs) -> bool:
    """A tensor-parallel load for `tpu`: `device_map` names tpu, or none is given while `tpu` is the
    accelerator and no `torch.distributed` process group exists (one process drives every chip)."""
    if not hasattr(_tensor_parallel_config(kwargs.get("parallel_config")), "tp_degree"):
        return False
    device_map = kwargs.get("device_map")
    if device_map is not None:
        return is_tpu(device_map)
    return torch.accelerator.current_accelerator().type == "tpu" and not (
        torch.distributed.is_available() and torch.distributed.is_initialized())


def _plan_styles(plan: dict) -> dict:
    """Diffusers' `_tp_plan` with its packed markers as `hf_tpu.distributed` style names. XLA keeps the
    values right for any split; a packed projection split as one block costs a reshard, never a result."""
    from diffusers.hooks.tensor_parallel import PackedColwiseParallel, PackedRowwiseParallel

    names = {PackedColwiseParallel: "packed_colwise", PackedRowwiseParallel: "packed_rowwise"}
    return {key: names.get(type(style), style) for key, style in plan.items()}


def _check_tensor_parallel(cls, pretrained_model_name_or_path, kwargs, degree: int) -> None:
    from hf_tpu import distributed

    chips = distributed.device_count()  # every process's chips after hf_tpu.distributed.initialize
    if degree > chips:
        raise ValueError(f"tp_degree={degree} needs {degree} tpu chips but this run has {chips} (on the CPU, "
                         "HF_TPU_NUM_DEVICES=N simulates N chips). Nothing was loaded.")
    if not getattr(cls, "_tp_plan", None):
        raise ValueError(f"{cls.__name__} has no tensor-parallel plan (`_tp_plan`). Nothing was loaded.")
    config = cls.load_config(pretrained_model_name_or_path, subfolder=kwargs.get("subfolder"))
    heads = config.get("num_attention_heads")
    if heads is not None and heads % degree:
        raise ValueError(f"tp_degree={degree} does not divide num_attention_heads={heads} of {cls.__name__}: each "
                         "chip must hold whole attention heads. Nothing was loaded.")


def _wrap_model_from_pretrained(original):
    @functools.wraps(original.__func__)
    def from_pretrained(cls, pretrained_model_name_or_path, *args, **kwargs):
        """On `tpu`, a tensor-parallel `parallel_config` shards the model over the local chips in this
        process (`hf_tpu.distributed.shard_model` with the model's own `_tp_plan`), without
        `torch.distributed`: the checkpoint is read on the host and each chip receives its shards."""
        if not _shards_on_tpu(kwargs):
            return original.__func__(cls, pretrained_model_name_or_path, *args, **kwargs)
        from hf_tpu import distributed

        degree = _tensor_parallel_config(kwargs.pop("parallel_config")).tp_degree
        _check_tensor_parallel(cls, pretrained_model_name_or_path, kwargs, degree)
        kwargs.pop("device_map", None)
        model = original.__func__(cls, pretrained_model_name_or_path, *args, **kwargs)
        return distributed.shard_model(model, _plan_styles(model._tp_plan), distributed.mesh(degree, "tp"))

    return classmethod(from_pretrained)


# --- Diffusers' test utilities


def _backend_entries() -> dict:
    """`testing_utils` table name -> what `tpu` puts there."""
    return {
        "BACKEND_SUPPORTS_TRAINING": True,
        "BACKEND_EMPTY_CACHE": torch.tpu.empty_cache,
        "BACKEND_DEVICE_COUNT": torch.tpu.device_count,
        "BACKEND_MANUAL_SEED": torch.tpu.manual_seed,
        "BACKEND_RESET_PEAK_MEMORY_STATS": torch.tpu.reset_peak_memory_stats,
        "BACKEND_RESET_MAX_MEMORY_ALLOCATED": torch.tpu.reset_peak_memory_stats,
        "BACKEND_MAX_MEMORY_ALLOCATED": torch.tpu.max_memory_allocated,
        "BACKEND_SYNCHRONIZE": torch.tpu.synchronize,
    }


def fill_backend_tables(testing_utils) -> None:
    """Adds `tpu` to each `BACKEND_*` table that lacks it (none while the module is still defining them)."""
    for name, entry in _backend_entries().items():
        table = getattr(testing_utils, name, None)
        if table is not None:
            table.setdefault("tpu", entry)


# --- Installation

_TESTING_UTILS = "diffusers.utils.testing_utils"


def install(module) -> None:
    """Patch the Diffusers module that was just imported (`hf_tpu.integrations.ADAPTERS`)."""
    if module.__name__ == "diffusers.schedulers.scheduling_utils":
        _install_schedulers(module)
    elif module.__name__ == "diffusers.pipelines.pipeline_utils":
        wrap_once(module.DiffusionPipeline, "_execution_device", _wrap_execution_device)
    elif module.__name__ == "diffusers.models.modeling_utils":
        wrap_once(module.ModelMixin, "from_pretrained", _wrap_model_from_pretrained)
    elif module.__name__ in (_TESTING_UTILS, "diffusers.hooks._common") and _TESTING_UTILS in sys.modules:
        # With DIFFUSERS_TEST_BACKEND=hf_tpu, testing_utils imports hf_tpu before it defines its tables;
        # `diffusers.hooks._common` is the next module it imports, after them.
        fill_backend_tables(sys.modules[_TESTING_UTILS])
