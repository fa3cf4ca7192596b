"""Every `HF_TPU_*` environment variable, parsed in one place.

Booleans accept 1/0, true/false, yes/no, on/off in any case; counts are positive integers (some a multiple of
a unit); lengths are comma-separated positive integers. A value that is none of these raises a ValueError
naming the variable and what it accepts, instead of being taken silently for something else or failing later
where it is used. An unset or empty variable means its default (except where empty is a value of its own:
HF_TPU_CACHE_DIR, where it turns the disk cache off, and the lengths, where it means none). Values are read
when they are used, so a change to `os.environ` applies from the next use on. `describe()` lists each setting
with the value in force and where it comes from, for `hf-tpu env`. Layers above the core declare their own
variables with `register`.

`import hf_tpu` validates every variable and raises the first malformed one's error, except in the `hf-tpu`
command: there a malformed variable reads as its default (`tolerate_malformed`), so that `hf-tpu env` can list
it with its error, and the other commands refuse to run with the same error, without a traceback.
"""

from __future__ import annotations

import dataclasses
import os

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


@dataclasses.dataclass(frozen=True)
class Setting:
    name: str
    # "bool", "count" (int >= 1), "index" (int >= 0), "seconds" (float >= 0), "choice", "lengths" (a sorted
    # tuple of distinct positive ints, from comma-separated text), "address" (host:port), "text"
    kind: str
    default: object
    help: str
    choices: tuple = ()
    empty_is_value: bool = False  # "" is a value of its own rather than "unset"
    multiple_of: int = 1  # a count's unit

    def accepted(self) -> str:
        if self.kind == "bool":
            return "a boolean: 1/0, true/false, yes/no, on/off (any case)"
        if self.kind == "count":
            return "a positive integer" if self.multiple_of == 1 else f"a positive multiple of {self.multiple_of}"
        if self.kind == "index":
            return "a non-negative integer"
        if self.kind == "seconds":
            return "a non-negative number of seconds"
        if self.kind == "choice":
            return "one of " + ", ".join(self.choices) + " (any case)"
        if self.kind == "lengths":
            return "positive lengths separated by commas (e.g. 32,64,128)" + (", or empty for none"
                                                                              if self.empty_is_value else "")
        if self.kind == "address":
            return "host:port, with a port from 1 to 65535"
        return "any text"

    def parse(self, text: str):
        """The value `text` (set, not empty unless `empty_is_value`) stands for; ValueError if malformed."""
        value = _PARSERS[self.kind](self, text.strip())
        if value is None:
            raise ValueError(f"{self.name}={text!r}: expected {self.accepted()}")
        return value


def _integer(text: str, least: int, multiple_of: int = 1):
    try:
        number = int(text)
    except ValueError:
        return None
    return number if number >= least and number % multiple_of == 0 else None


def _boolean(setting, text):
    return True if text.lower() in _TRUE else False if text.lower() in _FALSE else None


def _seconds(setting, text):
    try:
        seconds = float(text)
    except ValueError:
        return None
    return seconds if 0 <= seconds < float("inf") else None


def _choice(setting, text):
    return {c.lower(): c for c in setting.choices}.get(text.lower())


def _lengths(setting, text):
    lengths = [_integer(part.strip(), 1) for part in text.split(",") if part.strip()]
    if None in lengths or (not lengths and text):  # "," alone names no length
        return None
    return tuple(sorted(set(lengths)))


def _address(setting, text):
    host, _, port = text.rpartition(":")  # an IPv6 host is bracketed: [::1]:8476
    port_number = _integer(port, 1)
    return text if host and port_number is not None and port_number <= 65535 else None


_PARSERS = {
    "bool": _boolean,
    "count": lambda setting, text: _integer(text, 1, setting.multiple_of),
    "index": lambda setting, text: _integer(text, 0),
    "seconds": _seconds,
    "choice": _choice,
    "lengths": _lengths,
    "address": _address,
    "text": lambda setting, text: text,
}


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
    Setting("HF_TPU_COMPILE_DIRECT", "bool", True, "torch.compile(module, backend='tpu') traces the module's call "
            "straight from Python (hf_tpu.jit), with Dynamo for what that trace cannot take (off: Dynamo always)"),
    Setting("HF_TPU_MAX_GRAPH_OPS", "count", 4096, "DEFER_AND_FUSE: the most ops in one deferred graph"),
    Setting("HF_TPU_EARLY_FLUSH", "bool", True, "DEFER_AND_FUSE: cut graphs where a loop's iterations repeat"),
    Setting("HF_TPU_EARLY_FLUSH_MIN_OPS", "count", None, "DEFER_AND_FUSE: the shortest piece an early flush "
            "cuts (default: the platform's, 128 on a TPU, 8 elsewhere)"),
    Setting("HF_TPU_COORDINATOR_ADDRESS", "address", None, "multi-process run: host:port of process 0"),
    Setting("HF_TPU_NUM_PROCESSES", "count", None, "multi-process run: the number of processes"),
    Setting("HF_TPU_PROCESS_ID", "index", None, "multi-process run: this process's index"),
    Setting("HF_TPU_KERNELS", "choice", "auto", "Pallas kernels: auto (on a TPU where a kernel applies), xla (never), "
            "pallas (wherever one applies; off a TPU in Pallas interpret mode, slow, for tests)",
            choices=("auto", "xla", "pallas")),
    Setting("HF_TPU_KERNEL_BLOCK", "count", 512, "the largest query/key block of the Pallas attention kernel "
            "(a multiple of 128, the TPU's lane width)", multiple_of=128),
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


_tolerant = False


def tolerate_malformed(tolerate: bool = True) -> None:
    """From now on, a malformed variable reads as its default instead of raising (`describe` and `validate`
    still report it), or, with False, raises again: for the `hf-tpu` command only, whose process `import hf_tpu`
    starts tolerant, and which reports a malformed variable itself."""
    global _tolerant
    _tolerant = tolerate


def _default(name: str):
    return _cache_default() if name == "HF_TPU_CACHE_DIR" else SETTINGS[name].default


def _parsed(name: str):
    raw = _raw(name)
    return _default(name) if raw is None else SETTINGS[name].parse(raw)


def get(name: str):
    """The value in force for the setting `name` (an HF_TPU_* variable), parsed; ValueError if malformed."""
    try:
        return _parsed(name)
    except ValueError:
        if _tolerant:
            return _default(name)
        raise


def validate() -> None:
    """Raise the ValueError of the first malformed variable (at `import hf_tpu`, rather than at first use)."""
    for name in SETTINGS:
        _parsed(name)


def describe() -> list:
    """Every setting: {'name', 'value', 'source' ('env' or 'default'), 'error' (None, or why the variable's
    text is malformed: then 'value' is that text), 'accepted', 'help'}."""
    rows = []
    for name, setting in SETTINGS.items():
        try:
            value, error = _parsed(name), None
        except ValueError as e:
            value, error = os.environ[name], str(e)
        rows.append({"name": name, "value": value, "source": source(name), "error": error,
                     "accepted": setting.accepted(), "help": setting.help})
    return rows
