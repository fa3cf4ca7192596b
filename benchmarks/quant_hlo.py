"""What XLA on a v5e makes of a quantized Llama's programs, read without the chip: the prefill (`logits_to_keep=1`,
as `generate()`'s) traced on the CPU with the lowering's platform choices made as on a TPU (the int4 op takes its
Pallas kernel), compiled by libtpu for a v5e topology, and summarised by `benchmarks.quant.hlo_summary`: products,
products reading their integer weight inside their own fusion, dequantized weights written out.

    PYTHONPATH=<a folder holding libtpu> JAX_PLATFORMS=cpu python -m benchmarks.quant_hlo [--layers 2] [--rows 1x128]
    ... python -m benchmarks.quant_hlo --decode [--layers 2,4] [--rows 1x256]

`--decode`: the decode loop instead (`hf_tpu.while_loop` over one token's forward into a static cache of `length`
positions and its greedy choice, as `generate()`'s device loop), lowered for the v5e (`direct.while_loop`'s
`lower_for`); besides the summary, the HBM bytes one iteration moves (`loop_body_traffic`) at each depth, their
difference per layer, and the bytes a layer must read (its weights, scales and KV cache) beside it. XLA's own
`cost_analysis()` is no measure of this on a TPU: it counts the float32 values inside a fusion (about 4 bytes per
weight element in bfloat16 and int8 alike).

The 1.1B Llama's shapes (hidden 2048, MLP 5632) at fewer layers; Mosaic compiles the Pallas kernels on the host.
"""

from __future__ import annotations

import argparse
import re

CONFIGS = ("int4 group 128", "int8 weight-only")


def _config(name: str):
    from torchao.quantization import Int4WeightOnlyConfig, Int8WeightOnlyConfig

    return Int4WeightOnlyConfig(group_size=128) if name.startswith("int4") else Int8WeightOnlyConfig()


_PALLAS_CALL = 'custom_call_target="tpu_custom_call"'
_SHAPE = re.compile(r"([a-z]+[0-9]*)\[([0-9,]*)\](\{[^}]*\})?")
_BYTES = {"pred": 1, "s4": 0.5, "u4": 0.5, "s8": 1, "u8": 1, "bf16": 2, "f16": 2, "s16": 2, "u16": 2, "f32": 4,
          "s32": 4, "u32": 4, "f64": 8, "s64": 8, "u64": 8}
# no memory traffic of their own: views, tuples, the ends of asynchronous copies (counted at their start), the loop,
# custom calls other than Pallas kernels (the 64-bit integers' halves)
_NO_TRAFFIC = {"parameter", "constant", "bitcast", "get-tuple-element", "tuple", "reshape", "copy-done", "slice-done",
               "while", "custom-call", "after-all", "partition-id"}


def _arrays(type_text: str) -> list:
    """(bytes, in VMEM) of each array of an HLO type (`bf16[2,3]{1,0:T(8,128)S(1)}`, or a tuple of them)."""
    arrays = []
    for dtype, dims, layout in _SHAPE.findall(type_text):
        if dtype not in _BYTES:
            continue
        elements = 1
        for n in filter(None, dims.split(",")):
            elements *= int(n)
        arrays.append((elements * _BYTES[dtype], "S(1)" in (layout or "")))
    return arrays


def _computation_lines(text: str, name: str) -> list:
    start = text.index(f"\n%{name} ") + 1
    return text[start:text.index("\n}", start)].splitlines()[1:]


_LINE = re.compile(r"\s*(?:ROOT )?%(\S+) = (.*?) ([a-z][a-z0-9-]*)\((.*)$")
_SLICES = ("dynamic-slice", "slice", "gather")


def _fused_reads(text: str, fused: str) -> dict:
    """{parameter number: bytes read} of a fused computation's parameters that it only slices (an embedding row's
    `dynamic-slice` reads that row, not the table)."""
    types, users, numbers = {}, {}, {}
    for line in _computation_lines(text, fused):
        match = _LINE.match(line)
        if not match:
            continue
        name, type_text, op, rest = match.groups()
        types[name] = sum(b for b, _ in _arrays(type_text))
        if op == "parameter":
            numbers[name] = int(re.match(r"(\d+)", rest).group(1))
        for position, operand in enumerate(re.findall(r"%([\w.\-]+)", rest.split("),", 1)[0])):
            users.setdefault(operand, []).append((op if position == 0 else None, name))  # a slice's indices: read
    return {number: sum(types[user] for _, user in users[name]) for name, number in numbers.items()
            if users.get(name) and all(op in _SLICES for op, _ in users[name])}


def loop_body_traffic(text: str) -> int:
    """The bytes a device loop's iteration moves to and from HBM, by its optimized HLO (`as_text()` of the compiled
    loop): each top-level operation of the while loop's body reads its operands and writes its results, except
    those in VMEM (the `S(1)` memory space); an asynchronous copy or slice into VMEM reads what it copies, once;
    an update in place (`dynamic-update-slice`: a KV cache's new token) reads and writes its update alone."""
    body = re.search(r"body=%([\w.\-]+)", text).group(1)
    types, total = {}, 0
    for line in _computation_lines(text, body):
        match = _LINE.match(line)
        if not match:
            continue
        name, type_text, op, rest = match.groups()
        types[name] = _arrays(type_text)
        if op in _NO_TRAFFIC and not (op == "custom-call" and _PALLAS_CALL in rest):
            continue
        operands = re.findall(r"%([\w.\-]+)", rest.split("),", 1)[0])
        if op in ("copy-start", "slice-start"):  # HBM to or from VMEM: once; HBM to HBM: read and written
            # copy-start's type is (destination, source, context), slice-start's ((source), destination, context)
            (moved, to_vmem), (_, from_vmem) = types[name][:2] if op == "copy-start" else types[name][1::-1]
            total += moved if to_vmem or from_vmem else 2 * moved
            continue
        if op == "dynamic-update-slice":
            total += 2 * sum(b for b, _ in types.get(operands[1], []))
            continue
        sliced = _fused_reads(text, re.search(r"calls=%([\w.\-]+)", rest).group(1)) if op == "fusion" else {}
        total += sum(b for b, vmem in types[name] if not vmem)
        total += sum(sliced.get(i, b) for i, o in enumerate(operands) for b, vmem in types.get(o, []) if not vmem)
    return total


def _model(name: str, layers: int):
    """A `layers`-deep 1.1B-shaped Llama quantized with `name` (every linear layer but the LM head; "bf16": not
    quantized), on tpu."""
    import torch
    from torchao.quantization import quantize_
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=2048, intermediate_size=5632, num_hidden_layers=layers, num_attention_heads=32,
                         num_key_value_heads=4, vocab_size=32000, max_position_embeddings=2048)
    model = LlamaForCausalLM._from_config(config, dtype=torch.bfloat16).eval()
    if name != "bf16":
        quantize_(model, _config(name), filter_fn=lambda module, fqn: isinstance(module, torch.nn.Linear)
                  and fqn != "lm_head")
    return model.to("tpu")


def decode_text(name: str, layers: int, batch: int, length: int) -> tuple:
    """(the optimized HLO of the v5e-compiled decode loop, the bytes one layer must read a step: its quantized
    weights and scales, and its KV cache of `length` positions) of a `layers`-deep model quantized with `name`."""
    import torch
    from transformers import StaticCache

    from benchmarks.quant import step_bytes
    from benchmarks.train_memory import _topology_device, as_on_a_tpu
    from hf_tpu import direct

    model = _model(name, layers)
    config = model.config
    head_dim = config.hidden_size // config.num_attention_heads
    cache = StaticCache(config=config, max_cache_len=length)
    cache.early_initialization(batch_size=batch, num_heads=config.num_key_value_heads, head_dim=head_dim,
                               dtype=torch.bfloat16, device=model.device)
    limit = torch.tensor([length - 1], device="tpu")

    def step(tokens, position):
        logits = model(tokens[:, None], past_key_values=cache, cache_position=position,
                       position_ids=position.expand(tokens.shape[0], 1), use_cache=True).logits
        return torch.argmax(logits[:, -1].float(), dim=-1), position + 1

    def going_on(tokens, position):
        return position < limit

    carried = (torch.zeros(batch, dtype=torch.long, device="tpu"), torch.tensor([length // 2], device="tpu"))
    with torch.no_grad(), as_on_a_tpu():
        lowered = direct.while_loop(going_on, step, carried, (model, cache), run=False,
                                    lower_for=_topology_device("v5e:1x1"))
    head = model.lm_head.weight.numel() * model.lm_head.weight.element_size()
    cache_bytes = 2 * batch * config.num_key_value_heads * length * head_dim * 2
    return lowered.compile().as_text(), (step_bytes(model) - head) // layers + cache_bytes


def prefill_summary(name: str, layers: int, batch: int, length: int) -> dict:
    """`hlo_summary` of the v5e-compiled prefill of a `layers`-deep 1.1B-shaped Llama quantized with `name`."""
    import torch

    from benchmarks.quant import hlo_summary
    from benchmarks.train_memory import _topology_device, as_on_a_tpu
    from hf_tpu import direct

    model = _model(name, layers)
    config = model.config
    ids = torch.randint(0, config.vocab_size, (batch, length)).to("tpu")

    def _prefill_forward(ids):
        return model(ids, use_cache=False, logits_to_keep=1).logits

    with torch.no_grad(), as_on_a_tpu():
        lowered = direct.lower(_prefill_forward, (ids,), {}, state=(model,), device=_topology_device("v5e:1x1"))
    text = lowered.compile().as_text()
    summary = hlo_summary(text, config.hidden_size ** 2 // 8)
    summary["pallas_calls"] = text.count(_PALLAS_CALL)
    return summary


def decode_report(name: str, depths: list, batch: int, length: int) -> list:
    """Lines: the decode loop's summary and HBM bytes an iteration at each depth, then per layer against what a
    layer must read."""
    from benchmarks.quant import hlo_summary

    lines, moved = [], {}
    for layers in depths:
        text, must_read = decode_text(name, layers, batch, length)
        summary = hlo_summary(text, 2048 ** 2 // 8)
        moved[layers] = loop_body_traffic(text)
        lines.append(f"{name}, {layers} layers, decode loop {batch}x{length} on a v5e: {summary['products']} products,"
                     f" {summary['fused_conversions']} reading the integer weight in their fusion, "
                     f"{text.count(_PALLAS_CALL)} Pallas calls, "
                     f"{summary['written_dequantized']} dequantized weights written; an iteration moves "
                     f"{moved[layers] / 1e6:.2f} MB of HBM")
        print(lines[-1], flush=True)
    if len(depths) > 1:
        low, high = min(depths), max(depths)
        per_layer = (moved[high] - moved[low]) / (high - low)
        lines.append(f"{name}: a layer moves {per_layer / 1e6:.2f} MB an iteration; its weights, scales and KV cache "
                     f"hold {must_read / 1e6:.2f} MB ({per_layer / must_read:.3f}x)")
        print(lines[-1], flush=True)
    return lines


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", default=None, help="depth (default 2), or depths (2,4) with --decode")
    parser.add_argument("--rows", default=None, help="batch x length of the prompt (default 1x128), or with --decode "
                        "of the static cache (default 1x256)")
    parser.add_argument("--only", choices=("bf16", *CONFIGS), help="one quantization (default: each)")
    parser.add_argument("--decode", action="store_true", help="the decode loop, not the prefill")
    args = parser.parse_args(argv)
    batch, length = (int(n) for n in (args.rows or ("1x256" if args.decode else "1x128")).split("x"))
    depths = [int(n) for n in (args.layers or ("2,4" if args.decode else "2")).split(",")]
    for name in [args.only] if args.only else CONFIGS:
        if args.decode:
            decode_report(name, depths, batch, length)
            continue
        summary = prefill_summary(name, depths[0], batch, length)
        print(f"{name}, {depths[0]} layers, prefill {batch}x{length} on a v5e: {summary['products']} products, "
              f"{summary['fused_conversions']} reading the integer weight in their fusion, {summary['pallas_calls']} "
              f"Pallas calls, {summary['written_dequantized']} dequantized weights written "
              f"({summary['written_bytes'] / 1e6:.1f} MB)", flush=True)

if __name__ == "__main__":
    main()
