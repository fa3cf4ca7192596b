"""What XLA on a v5e makes of a quantized Llama's programs, read without the chip: the prefill (`logits_to_keep=1`,
as `generate()`'s) traced on the CPU with the lowering's platform choices made as on a TPU (the int4 op takes its
Pallas kernel), compiled by libtpu for a v5e topology, and summarised by `benchmarks.quant.hlo_summary`: products,
products reading their integer weight inside their own fusion, dequantized weights written out.

    PYTHONPATH=<a folder holding libtpu> JAX_PLATFORMS=cpu python -m benchmarks.quant_hlo [--layers 2] [--rows 1x128]

The 1.1B Llama's shapes (hidden 2048, MLP 5632) at fewer layers; Mosaic compiles the Pallas kernels on the host.
"""

from __future__ import annotations

import argparse

CONFIGS = ("int4 group 128", "int8 weight-only")


def _config(name: str):
    from torchao.quantization import Int4WeightOnlyConfig, Int8WeightOnlyConfig

    return Int4WeightOnlyConfig(group_size=128) if name.startswith("int4") else Int8WeightOnlyConfig()


def prefill_summary(name: str, layers: int, batch: int, length: int) -> dict:
    """`hlo_summary` of the v5e-compiled prefill of a `layers`-deep 1.1B-shaped Llama quantized with `name`."""
    import torch
    from torchao.quantization import quantize_
    from transformers import LlamaConfig, LlamaForCausalLM

    from benchmarks.quant import hlo_summary
    from benchmarks.train_memory import _topology_device, as_on_a_tpu
    from hf_tpu import direct

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=2048, intermediate_size=5632, num_hidden_layers=layers, num_attention_heads=32,
                         num_key_value_heads=4, vocab_size=32000, max_position_embeddings=2048)
    model = LlamaForCausalLM._from_config(config, dtype=torch.bfloat16).eval()
    quantize_(model, _config(name), filter_fn=lambda module, fqn: isinstance(module, torch.nn.Linear)
              and fqn != "lm_head")
    model.to("tpu")
    ids = torch.randint(0, config.vocab_size, (batch, length)).to("tpu")

    def _prefill_forward(ids):
        return model(ids, use_cache=False, logits_to_keep=1).logits

    with torch.no_grad(), as_on_a_tpu():
        lowered = direct.lower(_prefill_forward, (ids,), {}, state=(model,), device=_topology_device("v5e:1x1"))
    text = lowered.compile().as_text()
    summary = hlo_summary(text, config.hidden_size ** 2 // 8)
    summary["pallas_calls"] = text.count('custom_call_target="tpu_custom_call"')
    return summary


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--rows", default="1x128", help="batch x length of the prompt (default 1x128)")
    parser.add_argument("--only", choices=CONFIGS, help="one quantization (default: each)")
    args = parser.parse_args(argv)
    batch, length = (int(n) for n in args.rows.split("x"))
    for name in [args.only] if args.only else CONFIGS:
        summary = prefill_summary(name, args.layers, batch, length)
        print(f"{name}, {args.layers} layers, prefill {batch}x{length} on a v5e: {summary['products']} products, "
              f"{summary['fused_conversions']} reading the integer weight in their fusion, {summary['pallas_calls']} "
              f"Pallas calls, {summary['written_dequantized']} dequantized weights written "
              f"({summary['written_bytes'] / 1e6:.1f} MB)", flush=True)


if __name__ == "__main__":
    main()
