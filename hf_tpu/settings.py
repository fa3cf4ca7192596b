"""Every `HF_TPU_*` environment variable, parsed in one place.

Booleans accept 1/0, true/false, yes/no, on/off in any case; counts are positive integers. A value
that is none of these raises a ValueError naming the variable and what it accepts, instead of being
taken silently for something else. An unset or empty variable means its default (except
HF_TPU_CACHE_DIR, where empty turns the disk cache off). Values are read when they are used, so a
change to `os.environ` applies from the next use on. `describe()` lists each setting with the value
in force and where it comes from, for `hf-tpu env`. Layers above the core declare their own
variables with `register`.
"""

from __future__ import annotations

import dataclasses
import os

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


@dataclasses.dataclass(frozen=True)
class Setting:
    name: str
    kind: str  # "bool", "count" (int >= 1), "index" (int >= 0), "seconds" (float >= 0), "choice", "text"
    default: object
    help: str
    choices: tuple = ()
    empty_is_value: bool = False  # "" is a value of its own rather than "unset"

    def accepted(self) -> str:
        if self.kind == "bool":
            return "a boolean: 1/0, true/false, yes/no, on/off (any case)"
        if self.kind == "count":
            return "a positive integer"
        if self.kind == "index":
            return "a non-negative integer"
        if self.kind == "seconds":
            return "a non-negative number of seconds"
        if self.kind == "choice":
            return "one of " + ", ".join(self.choices) + " (any case)"
        return "any text"


def _cache_default() -> str:
    return os.path.join(os.path.expanduser("~"), ".cache", "hf_tpu")


_EAGER_MODES = ("DEFER_NEVER", "DEFER_AND_FUSE", "DEFER_NEVER_AND_LAUNCH_BLOCKING")

SETTINGS = {s.name: s for s in (
    Setting("HF_TPU_PLATFORM", "choice", "", "the JAX platform behind `tpu`; cpu also keeps JAX off any accelerator "
            "(JAX_PLATFORMS=cpu)", choices=("cpu", "gpu", "cuda", "rocm", "tpu")),
    Setting("HF_TPU_NUM_DEVICES", "count", None, "simulate this many chips on the CPU"),
    Setting("HF_TPU_CPU_FALLBACK", "bool", True, "run an op with no tpu lowering on the CPU (off: raise)"),
    Setting("HF_TPU_EAGER_MODE", "choice", "DEFER_NEVER", "the execution mode at start", choices=_EAGER_MODES),
    Setting("HF_TPU_CACHE_DIR", "text", None, "compiled programs on disk (default ~/.cache/hf_tpu; empty: off)",
            empty_is_value=True),
    Setting("HF_TPU_CHECK_INDICES", "bool", False, "raise an out-of-range index at the op's call, a host sync "
            "per indexing op (always on under DEFER_NEVER_AND_LAUNCH_BLOCKING; off: at the next host read)"),
    Setting("HF_TPU_LOG_COMPILES", "bool", False, "log compilations and where the program forced a sync"),
    Setting("HF_TPU_SLOW_COMPILE_SECONDS", "seconds", 5.0, "log each compile that takes longer than this, and "
            "say what is compiling while it does (0: never)"),
    Setting("HF_TPU_MAX_GRAPH_OPS", "count", 4096, "DEFER_AND_FUSE: the most ops in one deferred graph"),
    Setting("HF_TPU_EARLY_FLUSH", "bool", True, "DEFER_AND_FUSE: cut graphs where a loop's iterations repeat"),
    Setting("HF_TPU_EARLY_FLUSH_MIN_OPS", "count", None, "DEFER_AND_FUSE: the shortest piece an early flush "
            "cuts (default: the platform's, 128 on a TPU, 8 elsewhere)"),
    Setting("HF_TPU_COORDINATOR_ADDRESS", "text", None, "multi-process run: host:port of process 0"),
    Setting("HF_TPU_NUM_PROCESSES", "count", None, "multi-process run: the number of processes"),
    Setting("HF_TPU_PROCESS_ID", "index", None, "multi-process run: this process's index"),
    Setting("HF_TPU_KERNELS", "choice", "auto", "Pallas kernels: auto (on a TPU where a kernel applies), xla (never), "
            "pallas (wherever one applies; off a TPU in Pallas interpret mode, slow, for tests)",
            choices=("auto", "xla", "pallas")),
    Setting("HF_TPU_KERNEL_BLOCK", "count", 512, "the largest query/key block of the Pallas attention kernel "
            "(a multiple of 128)"),
    Setting("HF_TPU_ALLOW_UNSUPPORTED_TORCH", "bool", False, "import on an untested torch release"),
)}


def register(*settings: Setting) -> None:
    """Declare the variables a layer above the core reads (an adapter's own settings), so that they are
    parsed, validated and listed like the core's. Registering the same setting again is a no-op."""
    for setting in settings:
        known = SETTINGS.get(setting.name)
        if known is not None and known != setting:
            raise ValueError(f"{setting.name} is already registered with another meaning: {known}")
        SETTINGS[setting.name] = setting


def _raw(name: str):
    value = os.environ.get(name)
    if value is None or (value.strip() == "" and not SETTINGS[name].empty_is_value):
        return None
    return value


def source(name: str) -> str:
    """'env' where the variable sets the value, else 'default'."""
    return "default" if _raw(name) is None else "env"


def get(name: str):
    """The value in force for the setting `name` (an HF_TPU_* variable), parsed; ValueError if malformed."""
    setting = SETTINGS[name]
    raw = _raw(name)
    if raw is None:
        return _cache_default() if name == "HF_TPU_CACHE_DIR" else setting.default
    text = raw.strip()
    if setting.kind == "bool":
        if text.lower() in _TRUE:
            return True
        if text.lower() in _FALSE:
            return False
    elif setting.kind in ("count", "index"):
        try:
            number = int(text)
        except ValueError:
            number = None
        if number is not None and number >= (1 if setting.kind == "count" else 0):
            return number
    elif setting.kind == "seconds":
        try:
            seconds = float(text)
        except ValueError:
            seconds = None
        if seconds is not None and 0 <= seconds < float("inf"):
            return seconds
    elif setting.kind == "choice":
        folded = {c.lower(): c for c in setting.choices}
        if text.lower() in folded:
            return folded[text.lower()]
    else:
        return raw
    raise ValueError(f"{name}={raw!r}: expected {setting.accepted()}")


def validate() -> None:
    """Raise the ValueError of the first malformed variable (at `import hf_tpu`, rather than at first use)."""
    for name in SETTINGS:
        get(name)


def describe() -> list:
    """Every setting: {'name', 'value', 'source' ('env' or 'default'), 'accepted', 'help'}; a malformed
    variable's value is the error message."""
    rows = []
    for name, setting in SETTINGS.items():
        try:
            value = get(name)
        except ValueError as e:
            value = f"invalid: {e}"
        rows.append({"name": name, "value": value, "source": source(name), "accepted": setting.accepted(),
                     "help": setting.help})
    return rows
