"""Transformers' output-capturing hooks, installed before a model is compiled: a public helper shared by
the Transformers adapter (models loaded on `tpu`) and the Diffusers adapter (a pipeline's Transformers
text encoders, in `compile_pipeline`)."""

from __future__ import annotations


def install_output_capturing_hooks(module) -> None:
    """Installs the hooks a Transformers model records hidden states and attentions with, so that a
    `torch.compile` of the model finds them. Transformers installs them on the first call that asks for
    them, under a lock Dynamo cannot trace: compiled, that call breaks the graph for good, and every later
    call runs two graphs with eager code between them (a CLIP text encoder: 1.26 ms a call against 0.52 ms
    as one graph). The hooks do nothing unless a call asks for those outputs.

    A model that has run such a call has its hooks already, maybe on a submodel only (a
    `CLIPTextModelWithProjection` records on its `text_model`): installing again from the top would
    hook those layers twice and return each hidden state twice, so such a model is left as it is."""
    try:
        from transformers.utils.output_capturing import maybe_install_capturing_hooks
    except ImportError:  # a Transformers without lazily installed capturing hooks
        return
    from transformers import PreTrainedModel

    if isinstance(module, PreTrainedModel) and not any(
            getattr(m, "_output_capturing_hooks_installed", False) for m in module.modules()):
        maybe_install_capturing_hooks(module)


def capturing_hooks_traced() -> None:
    """Lets `torch.compile(model, backend="tpu")` trace a model holding Transformers' output-capturing hooks
    (`hf_tpu.compiled_modules`, which sends a module with hooks to Dynamo): each appends to a collector the
    decorated forward makes and reads within the call, so its effects stay within the call. A model's
    `generation_config` is left out of the compiled call's key: the forward does not read it."""
    try:
        from transformers.utils import output_capturing
    except ImportError:
        return
    from hf_tpu import compiled_modules

    compiled_modules.NOT_READ_BY_FORWARD.add("generation_config")  # `generate()`'s, not the forward's
    installer = getattr(output_capturing, "install_output_capuring_hook", None)  # sic, Transformers' spelling
    for code in getattr(getattr(installer, "__code__", None), "co_consts", ()):
        if getattr(code, "co_name", None) == "output_capturing_hook":
            compiled_modules.HOOKS_WITHIN_THE_CALL.add(code)
