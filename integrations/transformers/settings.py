"""How `generate()` runs on `tpu`: `configure(...)` and the settings it changes, with defaults from the
environment (`HF_TPU_PROMPT_BUCKETS`, `HF_TPU_CACHE_LENGTH_MULTIPLE`, `HF_TPU_STATIC_CACHE`,
`HF_TPU_DEVICE_LOOP`, `HF_TPU_DIRECT_TRACE`)."""

from __future__ import annotations

import dataclasses

from hf_tpu import settings as _environment


SCAN_LAYERS_CHOICES = ("checkpointed", "first-calls", "always", "off")
DEFAULT_PROMPT_BUCKETS = (16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)


_environment.register(
    _environment.Setting("HF_TPU_PROMPT_BUCKETS", "lengths", None, "Transformers generate: prompt lengths to pad to "
                         "(\"32,64,128\"; empty: no bucketing)", empty_is_value=True),
    _environment.Setting("HF_TPU_CACHE_LENGTH_MULTIPLE", "count", 128,
                         "Transformers generate: static cache length rounding"),
    _environment.Setting("HF_TPU_STATIC_CACHE", "bool", True, "Transformers generate: use a static KV cache"),
    _environment.Setting("HF_TPU_DEVICE_LOOP", "bool", True, "Transformers generate: decode in one compiled loop"),
    _environment.Setting("HF_TPU_DIRECT_TRACE", "bool", True, "Transformers generate: trace the prefill and the "
                         "decode loop with hf_tpu.jit (off: torch.compile)"),
    _environment.Setting("HF_TPU_SCAN_LAYERS", "choice", None, "Transformers decoders in hf_tpu.jit's trace: "
                         "run the layers as one scanned loop when checkpointed (checkpointed), also in a torch.compile'd "
                         "forward's first calls of a shape without a KV cache, while its unrolled program compiles "
                         "(first-calls), in every traced call without a KV cache (always), or unrolled (off); "
                         "default: first-calls on a TPU, checkpointed elsewhere",
                         choices=SCAN_LAYERS_CHOICES),
)


def _buckets_from_env() -> tuple[int, ...]:
    buckets = _environment.get("HF_TPU_PROMPT_BUCKETS")
    return DEFAULT_PROMPT_BUCKETS if buckets is None else buckets


def _scan_layers_from_env() -> str:
    """`first-calls` on a TPU: there XLA compiles the 1.1B Llama's unrolled 1x1024 forward in 15.6 s and its scanned
    one in 10.8 s, which serves until the unrolled program is ready. `checkpointed` elsewhere: the CPU's XLA
    compiles the unrolled forward in seconds and runs the scanned one several times slower (its per-call copy of
    the weights into stacked arrays)."""
    import hf_tpu

    return _environment.get("HF_TPU_SCAN_LAYERS") or ("first-calls" if hf_tpu.platform_name() == "tpu"
                                                       else "checkpointed")


def _valid_buckets(buckets) -> tuple[int, ...]:
    buckets = tuple(sorted(set(int(b) for b in buckets)))
    if any(b <= 0 for b in buckets):
        raise ValueError(f"prompt buckets must be positive lengths, got {buckets}")
    return buckets


@dataclasses.dataclass
class Settings:
    prompt_buckets: tuple[int, ...] = dataclasses.field(default_factory=_buckets_from_env)
    cache_length_multiple: int = dataclasses.field(
        default_factory=lambda: _environment.get("HF_TPU_CACHE_LENGTH_MULTIPLE"))
    static_cache: bool = dataclasses.field(default_factory=lambda: _environment.get("HF_TPU_STATIC_CACHE"))
    device_loop: bool = dataclasses.field(default_factory=lambda: _environment.get("HF_TPU_DEVICE_LOOP"))
    direct_trace: bool = dataclasses.field(default_factory=lambda: _environment.get("HF_TPU_DIRECT_TRACE"))
    scan_layers: str = dataclasses.field(default_factory=_scan_layers_from_env)


settings = Settings()


def configure(*, prompt_buckets=None, cache_length_multiple: int | None = None, static_cache: bool | None = None,
              device_loop: bool | None = None, direct_trace: bool | None = None, scan_layers: str | None = None):
    """Change how `generate()` and traced steps run on `tpu`.

    prompt_buckets: prompt lengths to left-pad to (a longer prompt goes to a multiple of the largest);
        `()` turns bucketing off.
    cache_length_multiple: the static cache length is rounded up to a multiple of this (1: exact).
    static_cache: False keeps Transformers' default dynamic cache (eager decoding, no compilation).
    device_loop: False decodes a static cache token by token from Python, one compiled forward per token,
        instead of all tokens after the first in one device loop.
    direct_trace: False compiles the prefill and the device loop's step with `torch.compile(backend="tpu")`
        (Dynamo and AOT autograd) instead of tracing them straight from Python with `hf_tpu.jit`.
    scan_layers: when a decoder's layers run as one scanned loop inside `hf_tpu.jit`'s trace
        (`scanned_layers`): "checkpointed" (layers checkpointed for training), "first-calls" (also a compiled
        forward's first calls of a shape; the default on a TPU), "always", or "off".
    """
    if prompt_buckets is not None:
        settings.prompt_buckets = _valid_buckets(prompt_buckets)
    if cache_length_multiple is not None:
        if cache_length_multiple < 1:
            raise ValueError(f"cache_length_multiple must be at least 1, got {cache_length_multiple}")
        settings.cache_length_multiple = int(cache_length_multiple)
    if static_cache is not None:
        settings.static_cache = bool(static_cache)
    if device_loop is not None:
        settings.device_loop = bool(device_loop)
    if direct_trace is not None:
        settings.direct_trace = bool(direct_trace)
    if scan_layers is not None:
        if scan_layers not in SCAN_LAYERS_CHOICES:
            raise ValueError(f"scan_layers must be one of {', '.join(SCAN_LAYERS_CHOICES)}, got {scan_layers!r}")
        settings.scan_layers = scan_layers
