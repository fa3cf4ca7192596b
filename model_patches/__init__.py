"""Per-architecture patches (shipped as `hf_tpu.model_patches`), one module an architecture family, chosen
by a compatibility table.

The table (`table.json`, written by `hf-tpu sweep --write`) says, per `config.model_type`, whether the
architecture runs on `tpu` as it is, runs once small patches are applied, or fails, and why. Patches change
how a model's Python code reaches the device (a host sync, a data-dependent shape, a padded prompt), never
its results.

The adapters call this package only through the interface below, never its modules' insides:

- Transformers models, by the table: `apply(model)` applies the patches `model.config.model_type` needs
  (each one `patch(model) -> None`, registered in `PATCHES` under the name the table uses), and
  `warn_if_failing(model_type)` warns at load time; both read the table once and are cheap afterwards.
  `pads_prompts(model)` says whether `generate()` may left-pad the model's prompts
  (`unpadded_prompts.py`: the models whose output depends on padding).
- Diffusers pipelines, every one of them: `patch_scheduler_class(cls)` keeps a scheduler's schedule on the
  host (`diffusers_schedulers.py`), and `patch_pipeline(pipe)` has the `DENOISERS` upload the host-side
  timestep (`diffusers_denoisers.py`): together they remove the denoising loop's host syncs.
- Every adapter and patch that puts a wrapper in place of a library's function: `wrapping.wrap_once` (once,
  keeping the original, which `wrapping.original_of` gives back), and `wrapping.is_tpu(device)`.
"""

from __future__ import annotations

import functools
import json
import warnings
from pathlib import Path
from typing import Callable

from . import unpadded_prompts
from .diffusers_denoisers import DENOISERS, patch_pipeline
from .diffusers_schedulers import patch_scheduler_class
from .unpadded_prompts import pads_prompts

__all__ = ["DENOISERS", "PATCHES", "apply", "load_table", "lookup", "pads_prompts", "patch_pipeline",
           "patch_scheduler_class", "patches_for", "render_markdown", "warn_if_failing"]

TABLE_PATH = Path(__file__).with_name("table.json")
DOCS_POINTER = "docs/compatibility.md in the hf-tpu repository"
STATUSES = ("works", "works with patches", "fails")
REQUIRED_FIELDS = ("status", "tested_class", "patches", "limits", "checked", "versions")
VERSION_FIELDS = ("torch", "jax", "transformers", "hf_tpu")

# name -> patch(model), as the table's "patches" lists name them
PATCHES: dict[str, Callable] = {unpadded_prompts.NAME: unpadded_prompts.patch}

_APPLIED_ATTRIBUTE = "_hf_tpu_patches_applied"


@functools.cache
def load_table() -> dict:
    """The whole table: {"architectures": {model_type: entry}, "not_checked": {model_type: reason}}."""
    with open(TABLE_PATH, encoding="utf-8") as f:
        return json.load(f)


def lookup(model_type: str) -> dict | None:
    """The table's entry for `model_type`, or None when the architecture was never checked on `tpu`."""
    return load_table()["architectures"].get(model_type)


def patches_for(model_type: str) -> list[str]:
    entry = lookup(model_type)
    return list(entry["patches"]) if entry else []


def apply(model) -> list[str]:
    """Applies the patches `model.config.model_type` needs, once per model; returns the names applied now."""
    applied = getattr(model, _APPLIED_ATTRIBUTE, set())
    pending = [name for name in patches_for(model.config.model_type) if name not in applied]
    for name in pending:
        PATCHES[name](model)
    setattr(model, _APPLIED_ATTRIBUTE, applied | set(pending))
    return pending


def warn_if_failing(model_type: str) -> None:
    """Warns, at load time, when the table says this architecture fails on `tpu`, with the reason."""
    entry = lookup(model_type)
    if entry is not None and entry["status"] == "fails":
        warnings.warn(
            f"'{model_type}' is known to fail on tpu: {entry['limits']} (checked {entry['checked']}). "
            f"See {DOCS_POINTER} for what runs and what to do.",
            stacklevel=2,
        )


def render_markdown(table: dict | None = None) -> str:
    """The architecture section of docs/compatibility.md, generated from the table."""
    table = load_table() if table is None else table
    architectures = table["architectures"]
    counts = {status: sum(e["status"] == status for e in architectures.values()) for status in STATUSES}
    lines = [
        f"{len(architectures)} architectures checked: " + ", ".join(f"{n} {s}" for s, n in counts.items())
        + f"; {len(table['not_checked'])} not checked (their tiny configuration does not run on CPU either).",
        "",
        "| model_type | status | class checked | patches | known limits / reason | checked with |",
        "|---|---|---|---|---|---|",
    ]
    for model_type, entry in sorted(architectures.items()):
        versions = entry["versions"]
        checked = (f"{entry['checked']}: torch {versions['torch']}, jax {versions['jax']}, "
                   f"transformers {versions['transformers']}, hf_tpu {versions['hf_tpu']}")
        limits = entry["limits"].replace("|", "\\|").replace("\n", " ")
        lines.append(f"| `{model_type}` | {entry['status']} | {entry['tested_class']} | "
                     f"{', '.join(entry['patches']) or '-'} | {limits or '-'} | {checked} |")
    if table["not_checked"]:
        lines += ["", "Not checked (the tiny configuration fails on CPU, so there is nothing to compare):", ""]
        for model_type, reason in sorted(table["not_checked"].items()):
            lines.append(f"- `{model_type}`: {reason.replace(chr(10), ' ')}")
    return "\n".join(lines) + "\n"
