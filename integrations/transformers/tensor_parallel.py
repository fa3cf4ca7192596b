"""Tensor-parallel loading on `tpu`: `from_pretrained(..., device_map="tpu", tp_plan="auto")` shards the
model over the chips of the run with `hf_tpu.distributed.shard_model`, without `torch.distributed`."""

from __future__ import annotations

from . import loading  # its checks and preparation (loading hands a tensor-parallel load to this module)


ARGUMENTS = ("tp_plan", "tp_size", "distributed_config")


def _tensor_parallel_request(kwargs) -> tuple:
    """(plan, size) from `tp_plan=`/`tp_size=` or a `DistributedConfig`, removed from `kwargs`: on tpu
    they shard over the chips of the run (this process's, or every process's after
    `hf_tpu.distributed.initialize`) instead of starting `torch.distributed`."""
    from hf_tpu import distributed

    config = kwargs.pop("distributed_config", None)
    plan = kwargs.pop("tp_plan", None) or getattr(config, "tp_plan", None) or "auto"
    size = kwargs.pop("tp_size", None) or getattr(config, "tp_size", None) or distributed.device_count()
    return plan, size


def _check_tensor_parallel(pretrained_model_name_or_path, kwargs, size: int) -> None:
    """The errors a sharded load raises before any weight is read."""
    from transformers import AutoConfig

    from hf_tpu import distributed

    chips = distributed.device_count()
    if size > chips:
        raise ValueError(f"tp_size={size} needs {size} tpu chips but this run has {chips} "
                         "(on the CPU, HF_TPU_NUM_DEVICES=N simulates N chips). Nothing was loaded.")
    config = kwargs.get("config")
    if not hasattr(config, "get_text_config"):
        config = AutoConfig.from_pretrained(pretrained_model_name_or_path)
    text = config.get_text_config()
    for name in ("num_attention_heads", "num_key_value_heads"):
        heads = getattr(text, name, None)
        if heads is not None and heads % size:
            raise ValueError(f"tp_size={size} does not divide {name}={heads} of this {text.model_type} "
                             "model: each chip must hold whole attention heads. Nothing was loaded.")


def load_sharded(original, cls, pretrained_model_name_or_path, args, kwargs):
    """`from_pretrained(..., device_map="tpu", tp_plan="auto")`: the checkpoint is read on the host and
    each weight goes to the chips as its shards (`hf_tpu.distributed.shard_model`), so no chip ever
    holds a whole weight that the plan splits."""
    from hf_tpu import distributed

    plan, size = _tensor_parallel_request(kwargs)
    _check_tensor_parallel(pretrained_model_name_or_path, kwargs, size)
    loading.check_before_loading(pretrained_model_name_or_path, kwargs.get("dtype", kwargs.get("torch_dtype")))
    kwargs.pop("device_map")
    # the blocked attention op keeps batch and heads apart for any head count, so a head-sharded layer
    # needs only its 2 all-reduces; SDPA's math path (taken for grouped-query heads) merges them for its
    # bmm and adds 3 all-gathers; see docs/design/sharding.md
    kwargs.setdefault("attn_implementation", "tpu")
    model = original.__func__(cls, pretrained_model_name_or_path, *args, **kwargs)
    if plan == "auto":
        plan = model.tp_plan
    if not plan:
        raise ValueError(f"{type(model).__name__} has no tensor-parallel plan of its own: pass tp_plan= a dict "
                         "of module patterns to styles ('colwise', 'rowwise', ...).")
    distributed.shard_model(model, plan, distributed.mesh(size, "tp"))
    loading.prepare_model(model)
    return model
