"""Hugging Face adapters (shipped as `hf_tpu.integrations`): they use the `tpu` device only through
its public contract (`torch.accelerator`, `torch.tpu`, `hf_tpu`'s public functions).

`import hf_tpu` calls `activate()` through the entry point this package declares in the group
`hf_tpu.adapters` (the core names no adapter). It installs each adapter as soon as the library it adapts
is imported: at once if it already is, otherwise from a post-import hook, so that importing hf_tpu never
imports (or slows down) a Hugging Face library the user does not use. This post-import hook is the one
hook that lives with the adapters.

One module a library (`transformers/` and `accelerate/`, packages split by job; `diffusers.py`;
`sentence_transformers.py`; `torchao.py`, for torchao's quantized tensors), with `attention.py`
(`attn_implementation="tpu"`) and `output_capturing.py` (a helper both the Transformers and the Diffusers
adapters use). Per-architecture patches are in `hf_tpu.model_patches`, below the adapters; every adapter and patch wraps a
library's function the core's one way (`hf_tpu.wrapping.wrap_once`); the command line (`hf-tpu`, the sweep among
it) is in `hf_tpu.cli`.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import logging
import sys
import threading

log = logging.getLogger("hf_tpu.integrations")

# module whose import triggers an adapter -> the adapter module, whose `install(module)` patches it
ADAPTERS = {
    "transformers.modeling_utils": "hf_tpu.integrations.transformers",
    "transformers.models.auto.auto_factory": "hf_tpu.integrations.transformers",
    "transformers.generation.utils": "hf_tpu.integrations.transformers",
    "transformers.trainer": "hf_tpu.integrations.transformers",
    "transformers.training_args": "hf_tpu.integrations.transformers",
    "transformers.integrations.sdpa_attention": "hf_tpu.integrations.transformers",
    "transformers.generation.continuous_batching.cache": "hf_tpu.integrations.transformers",
    "transformers.generation.continuous_batching.initialization": "hf_tpu.integrations.transformers",
    "diffusers.schedulers.scheduling_utils": "hf_tpu.integrations.diffusers",
    "diffusers.pipelines.pipeline_utils": "hf_tpu.integrations.diffusers",
    "diffusers.models.modeling_utils": "hf_tpu.integrations.diffusers",
    "diffusers.utils.testing_utils": "hf_tpu.integrations.diffusers",
    "diffusers.hooks._common": "hf_tpu.integrations.diffusers",
    "accelerate.state": "hf_tpu.integrations.accelerate",
    "accelerate.accelerator": "hf_tpu.integrations.accelerate",
    "accelerate.utils.dataclasses": "hf_tpu.integrations.accelerate",
    "sentence_transformers.base.modules.transformer": "hf_tpu.integrations.sentence_transformers",
    "sentence_transformers.base.model": "hf_tpu.integrations.sentence_transformers",
    "torchao.quantization": "hf_tpu.integrations.torchao",
}


def _install(module_name: str) -> None:
    adapter = importlib.import_module(ADAPTERS[module_name])
    try:
        adapter.install(sys.modules[module_name])
    except Exception:
        # an adapter that cannot install must not break the user's import of the library
        log.exception("hf_tpu: the adapter for %s could not be installed", module_name)


class _LoaderWithHook(importlib.abc.Loader):
    """Runs the wrapped loader, then installs the adapter into the freshly executed module."""

    def __init__(self, loader, module_name: str):
        self.loader = loader
        self.module_name = module_name

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module):
        self.loader.exec_module(module)
        _install(self.module_name)

    def __getattr__(self, name):  # get_source, get_code, is_package, ... for tools that ask the loader
        return getattr(self.loader, name)


class _PostImportHook(importlib.abc.MetaPathFinder):
    """A `sys.meta_path` entry that only reacts to the module names in `ADAPTERS`."""

    def __init__(self):
        self._finding = threading.local()

    def find_spec(self, fullname, path, target=None):
        if fullname not in ADAPTERS or getattr(self._finding, "active", False):
            return None
        self._finding.active = True  # let the other finders find the real module
        try:
            spec = importlib.util.find_spec(fullname)
        finally:
            self._finding.active = False
        if spec is None or spec.loader is None:
            return None
        spec.loader = _LoaderWithHook(spec.loader, fullname)
        return spec


_hook = _PostImportHook()


def activate() -> None:
    """Install every adapter whose library is imported, and arrange for the others on their import."""
    for module_name in ADAPTERS:
        if module_name in sys.modules:
            _install(module_name)
    if _hook not in sys.meta_path:
        sys.meta_path.insert(0, _hook)
