"""`benchmarks.chip`'s quantization groups: quantized models beside bfloat16 ones in one run.

- `quant`: the Llama model (the 1.1B on a TPU) loaded from a bfloat16 checkpoint with Transformers' torchao configs,
  `device_map="tpu"`: its decode tokens/s at each batch in bfloat16, int8 weight-only and int4 (groups of 128)
  against the HBM limit of the bytes each reads a step; its prefill (`logits_to_keep=1`, as `generate()`'s) at
  batch x length in bfloat16 and with int8 activations and weights; what XLA made of each quantized program
  (whether the weight's conversion is fused into its product, whether the int8 products are int8 x int8 -> int32,
  whether a dequantized weight is written out); and the 16 layers' weight products alone in raw JAX in each form
  (bfloat16, int8, the int4 lowering's, an int4 array JAX keeps itself), which tells what the chip's XLA reads.
- `quant_big`: a 7B Llama- and a 9B Qwen3-shaped model with random weights, written layer by layer as a bfloat16
  safetensors checkpoint (bounded in time and disk), loaded in int8 straight onto the chip (peak device memory
  against the quantized weights, loading GB/s), then decoding against the HBM limit. In bfloat16 the 9B model's
  18 GB do not fit a v5e's 15.75 GiB.

On the CPU the same work runs at a tiny size (`--size tiny`), as the other groups do.
"""

from __future__ import annotations

import gc
import glob
import json
import os
import re
import shutil
import sys
import tempfile
import time

# the HLO XLA dumps for the programs summarised (`_hlo_summary`): generate()'s and the prefill's
_DUMPED_PROGRAMS = r".*(loop_body|traced__prefill_forward|traced_forward).*"


def _dump_hlo_here() -> str:
    """A folder XLA dumps the optimized HLO of the traced programs into: set before JAX starts (in the worker)."""
    folder = tempfile.mkdtemp(prefix="hf-tpu-quant-hlo-")
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + f" --xla_dump_to={folder} --xla_dump_hlo_as_text"
                               f" --xla_dump_hlo_pass_re=^$ --xla_dump_hlo_module_re={_DUMPED_PROGRAMS}").strip()
    return folder


def _configs(spec: dict) -> dict:
    from torchao.quantization import Int4WeightOnlyConfig, Int8DynamicActivationInt8WeightConfig, Int8WeightOnlyConfig

    return {"bf16": None, "int8 weight-only": Int8WeightOnlyConfig(),
            f"int4 group {spec['int4_group']}": Int4WeightOnlyConfig(group_size=spec["int4_group"]),
            "int8 activations+weights": Int8DynamicActivationInt8WeightConfig()}


def _load(path: str, config, device_map="tpu"):
    import torch
    from transformers import AutoModelForCausalLM, TorchAoConfig

    quantization = TorchAoConfig(config) if config is not None else None
    return AutoModelForCausalLM.from_pretrained(path, quantization_config=quantization, dtype=torch.bfloat16,
                                                device_map=device_map).eval()


def step_bytes(model) -> int:
    """Bytes a decode step reads of the model's weights: every parameter but the input embedding (a row a token),
    a quantized one as the bytes of its int data and scales."""
    embedding = model.get_input_embeddings().weight
    total = 0
    for parameter in model.parameters():
        if parameter is embedding:
            continue
        inner = parameter.__tensor_flatten__()[0] if hasattr(parameter, "__tensor_flatten__") else None
        tensors = [getattr(parameter, name) for name in inner] if inner else [parameter]
        total += sum(t.numel() * t.element_size() for t in tensors)
    return total


def _dumped(folder: str) -> set:
    return set(glob.glob(os.path.join(folder, "*after_optimizations.txt")))


# --- What XLA made of a program: its optimized HLO, read back from the dump

_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%(\S+) = (\(?[a-z0-9]+)\[([0-9,]*)\][^ ]* ([a-z-]+)\((.*)$")
_COMPUTATION = re.compile(r"^(?:ENTRY )?%(\S+) \(.*\{$")
# ops a weight passes through between its parameter and a product: its conversion, scaling, unpacking, layout
_ON_THE_WAY = {"convert", "bitcast", "copy", "transpose", "reshape", "broadcast", "multiply", "add", "subtract",
               "shift-right-arithmetic", "shift-right-logical", "shift-left", "and", "or", "slice", "concatenate",
               "bitcast-convert", "select"}
_INTEGER = ("s4", "u4", "s8", "u8")


def _computations(text: str) -> dict:
    """{computation: {instruction: (dtype, elements, op, operand names)}} of an HLO module's text; the root's name
    under the key None."""
    computations, current = {}, None
    for line in text.splitlines():
        match = _COMPUTATION.match(line)
        if match:
            current = computations.setdefault(match.group(1), {})
            continue
        match = _INSTRUCTION.match(line) if current is not None else None
        if match:
            name, dtype, shape, op, rest = match.groups()
            elements = 1
            for n in filter(None, shape.split(",")):
                elements *= int(n)
            operands = re.findall(r"%([\w.\-]+)", rest.split("),", 1)[0])
            current[name] = (dtype.lstrip("("), elements, op, operands)
            if line.lstrip().startswith("ROOT "):
                current[None] = name
    return computations


def _integer_source(instructions: dict, name: str, seen: set) -> bool:
    """Whether `name` is computed, within its computation, from an integer array by conversions and elementwise
    work (a quantized weight's dequantization)."""
    if name in seen or name not in instructions:
        return False
    seen.add(name)
    dtype, _, op, operands = instructions[name]
    if dtype in _INTEGER:
        return True
    return op in _ON_THE_WAY and any(_integer_source(instructions, o, seen) for o in operands)


def _product_operands(instructions: dict, name: str) -> list | None:
    """The two operands of a product: a dot's or a convolution's, or those of the multiply a reduce sums (XLA on
    a TPU writes a product with one row, a batch-1 decode step's every linear layer, as an elementwise multiply
    by the broadcast row and a reduce over the contracted dimension: a matrix-vector product on the vector unit);
    None for any other instruction."""
    _, _, op, operands = instructions[name]
    if op in ("dot", "convolution"):
        return operands[:2]
    if op != "reduce" or not operands:
        return None
    summed, seen = operands[0], set()
    while summed in instructions and summed not in seen:  # through the conversion of the product to its dtype
        seen.add(summed)
        _, _, op, inner = instructions[summed]
        if op == "multiply":
            return inner[:2]
        if op not in ("convert", "bitcast", "copy") or not inner:
            return None
        summed = inner[0]
    return None


def _written(instructions: dict) -> list:
    """(dtype, elements) of each array a computation returns (its root, or each of a tuple root's elements)."""
    root = instructions.get(None)
    if root is None:
        return []
    dtype, elements, op, operands = instructions[root]
    return ([(instructions[o][0], instructions[o][1], o) for o in operands if o in instructions] if op == "tuple"
            else [(dtype, elements, root)])


def hlo_summary(text: str, least_elements: int) -> dict:
    """What XLA made of the products of a program whose weights are quantized: `products` (dots, convolutions, and
    reduces of a multiply, XLA's form of a product with one row, `_product_operands`), `int8_products` (of int8
    operands), `fused_conversions` (products reading an integer array inside their own fusion: as an operand, or
    converted to floats there), and `written_dequantized` (computations that return a float array of at least
    `least_elements` computed from an integer array: a dequantized weight written to memory, with its
    `written_bytes`)."""
    summary = dict(products=0, int8_products=0, fused_conversions=0, written_dequantized=0, written_bytes=0)
    for instructions in _computations(text).values():
        for name in [n for n in instructions if n is not None]:
            operands = _product_operands(instructions, name)
            if operands is None:
                continue
            kinds = [instructions[o][0] for o in operands if o in instructions]
            if instructions[name][2] == "reduce" and not any(_integer_source(instructions, o, set())
                                                             for o in operands):
                continue  # a reduce of a product of floats: a product only where it reads a quantized weight
            summary["products"] += 1
            if kinds and all(k in ("s8", "u8") for k in kinds):
                summary["int8_products"] += 1
            elif any(_integer_source(instructions, o, set()) for o in operands):
                summary["fused_conversions"] += 1
        for dtype, elements, name in _written(instructions):
            if (dtype in ("bf16", "f32", "f16") and elements >= least_elements
                    and _integer_source(instructions, name, set())):
                summary["written_dequantized"] += 1
                summary["written_bytes"] += elements * (4 if dtype == "f32" else 2)
    return summary


def _summaries(folder: str, files, least_elements: int) -> dict:
    """{program: hlo_summary} of the dumped programs among `files` (a program compiled twice: its last)."""
    out = {}
    for path in sorted(files):
        program = re.sub(r"^module_\d+\.jit_|\..*$", "", os.path.basename(path))
        with open(path) as f:
            out[program] = hlo_summary(f.read(), least_elements)
    return out


# --- The raw-JAX forms of the quantized products


def _forms(spec: dict, rows, device, batch: int) -> None:
    """The Llama model's layers' weight products alone (attention's projections and the MLP, no LM head), in raw
    JAX at `batch` rows, with the weights in each form, timed per call: what XLA reads of each form on this
    platform, beside the bytes it holds. int4 "two products" is `hf_tpu::int4_linear`'s XLA form (the even and
    odd input features times the low and high nibbles of the packed bytes); "int4 lowering" is the op's lowering
    as it runs here (on a TPU, the Pallas kernel `hf_tpu.kernels.int4_matmul` where its shape rules hold, the XLA
    form elsewhere); "interleaved" puts the nibbles back in
    column order into one operand (a change of the minor dimension's layout); "JAX int4 array" keeps the weight as
    an `int4` array, which XLA stores two to a byte itself: what an int4 layout of XLA's own would read."""
    import jax
    import jax.numpy as jnp

    from benchmarks.chip import _head_dim, _median_seconds
    from hf_tpu.ops.quantized import int4_linear, two_products

    config = spec["model"]
    h, d, group = config["hidden_size"], _head_dim(config), spec["int4_group"]
    shapes = [(config["num_attention_heads"] * d, h), (config["num_key_value_heads"] * d, h),
              (config["num_key_value_heads"] * d, h), (h, config["num_attention_heads"] * d),
              (config["intermediate_size"], h), (config["intermediate_size"], h), (h, config["intermediate_size"])]
    keys = iter(jax.random.split(jax.random.key(1), 8 * len(shapes) * config["num_hidden_layers"] + 2))
    put = lambda x: jax.device_put(x, device)  # noqa: E731

    def weights(form, shape):  # (out, in) as PyTorch's linear layers keep them
        out_features, in_features = shape
        if form == "bf16":
            return (put(jax.random.normal(next(keys), shape, jnp.bfloat16) * 0.02),)
        if form == "int8":
            return (put(jax.random.randint(next(keys), shape, -127, 128, jnp.int8)),
                    put(jnp.full((out_features, 1), 1e-3, jnp.bfloat16)))
        groups = (in_features // group, out_features)
        scales = (put(jnp.full(groups, 1e-2, jnp.bfloat16)), put(jnp.zeros(groups, jnp.bfloat16)))
        if form in ("int4 two products", "int4 lowering", "int4 interleaved"):
            return (put(jax.random.randint(next(keys), (out_features, in_features // 2), -128, 128, jnp.int8)),
                    *scales)
        return (put(jax.random.randint(next(keys), shape, -8, 8, jnp.int8).astype(jnp.int4)), *scales)

    def product(form, x, w):
        if form == "bf16":
            return x @ w[0].T
        if form == "int8":
            return (x @ w[0].T.astype(x.dtype)) * w[1][:, 0]
        if form == "int4 two products":
            return two_products(x, *w, group)
        if form == "int4 lowering":
            return int4_linear(x, *w, group)
        if form == "int4 interleaved":  # the nibbles put back in column order: one operand of (out, in)
            packed, scale, zero = w
            q = jnp.stack([(packed << 4) >> 4, packed >> 4], axis=-1).reshape(packed.shape[0], -1)
            grouped = q.astype(jnp.bfloat16).reshape(q.shape[0], -1, group)
            return x @ (grouped * scale.T[:, :, None] + zero.T[:, :, None]).reshape(q.shape).T
        q, scale, zero = w
        grouped = q.astype(jnp.bfloat16).reshape(q.shape[0], -1, group)
        return x @ (grouped * scale.T[:, :, None] + zero.T[:, :, None]).reshape(q.shape).T

    x0 = put(jax.random.normal(next(keys), (batch, h), jnp.bfloat16))
    for form in ("bf16", "int8", "int4 two products", "int4 lowering", "int4 interleaved", "int4 JAX int4 array"):
        layers = [[weights(form, shape) for shape in shapes] for _ in range(config["num_hidden_layers"])]
        held = sum(a.size * a.dtype.itemsize for layer in layers for w in layer for a in w)
        if form == "int4 JAX int4 array":
            held -= sum(w[0].size // 2 for layer in layers for w in layer)  # two to a byte in XLA's layout

        @jax.jit
        def run(x, layers, form=form):
            for wq, wk, wv, wo, wg, wu, wd in layers:
                k, v = product(form, x, wk), product(form, x, wv)
                used = (k.sum(-1, keepdims=True) + v.sum(-1, keepdims=True)).astype(x.dtype)
                up = product(form, x, wg) * product(form, x, wu)
                x = x + product(form, product(form, x, wq), wo) + product(form, up, wd) + used
            return x

        seconds = _median_seconds(lambda: run(x0, layers).block_until_ready(), spec["iters"])
        rows.emit("quant_forms", form=form, batch=batch, seconds=seconds, bytes=held,
                  layers=config["num_hidden_layers"])
        del layers
        gc.collect()


# --- The groups


def _each_variant(spec: dict, rows, folder: str, names: tuple, work) -> None:
    """The Llama model saved once as a bfloat16 checkpoint, then loaded with `device_map="tpu"` in each variant of
    `names` (a bfloat16 one and torchao configs, `_configs`), one at a time: its load timed, `work(name, model)`
    run, and XLA's optimized HLO of the traced programs the variant compiled, dumped under `folder`
    (`_dump_hlo_here`), summarised (`hlo_summary`)."""
    import torch

    from benchmarks.chip import _llama

    checkpoint = tempfile.mkdtemp(prefix="hf-tpu-quant-llama-")
    configs = _configs(spec)
    least = spec["model"]["hidden_size"] ** 2 // 8  # the smallest quantized weight's packed int4 half
    try:
        _llama(spec).save_pretrained(checkpoint)
        for name in names:
            dumped = _dumped(folder)
            started = time.perf_counter()
            model = _load(checkpoint, configs[name])
            torch.accelerator.synchronize()
            rows.emit("quant_load", variant=name, seconds=time.perf_counter() - started, step_bytes=step_bytes(model))
            work(name, model)
            if configs[name] is not None:
                for program, summary in _summaries(folder, _dumped(folder) - dumped, least).items():
                    rows.emit("quant_hlo", variant=name, program=program, **summary)
            del model
            gc.collect()
    finally:
        shutil.rmtree(checkpoint, ignore_errors=True)
        shutil.rmtree(folder, ignore_errors=True)


def group_quant(spec: dict, rows) -> None:
    """Decode tokens/s in bfloat16, int8 weight-only and int4 at each batch of the grid, after its first prompt
    length."""
    folder = _dump_hlo_here()  # before JAX starts
    from benchmarks.chip import _generate, _ids, _step_seconds, kv_bytes_per_token, measure_limits

    measure_limits(spec, rows)  # the HBM bandwidth the limits are figured at
    vocab, steps, prompt = spec["model"]["vocab_size"], spec["quant_steps"], spec["lengths"][0]

    def decode(name, model):
        generate = _generate(model)
        for batch in spec["batches"]:
            ids = _ids(vocab, batch, prompt).to("tpu")
            step, first = _step_seconds(generate, ids, steps, max(2, spec["iters"] // 3))
            if step is None:
                rows.skip(f"{name} decode {batch}x{prompt}", "a decode step is below the timing noise")
                continue
            rows.emit("quant_decode", variant=name, batch=batch, length=prompt, step_seconds=step, first_call=first,
                      context=prompt + steps // 2, step_bytes=step_bytes(model),
                      kv_bytes_per_token=kv_bytes_per_token(spec["model"]))

    _each_variant(spec, rows, folder, ("bf16", "int8 weight-only", f"int4 group {spec['int4_group']}"), decode)


def group_quant_prefill(spec: dict, rows) -> None:
    """The prefill (`logits_to_keep=1`, as `generate()`'s, traced with `hf_tpu.jit`) in bfloat16 and with int8
    activations and weights; then the weight products alone in raw JAX in each form (`_forms`)."""
    folder = _dump_hlo_here()  # before JAX starts
    import torch

    import hf_tpu
    from benchmarks.chip import _ids, _median_seconds, measure_limits

    device = measure_limits(spec, rows)
    batch, length = spec["quant_prefill"]
    ids = _ids(spec["model"]["vocab_size"], batch, length)

    def prefill(name, model):
        def forward(ids):
            return model(ids, use_cache=False, logits_to_keep=1).logits

        traced, on_tpu = hf_tpu.jit(forward, state=(model,)), ids.to("tpu")

        def run():
            with torch.no_grad():
                traced(on_tpu)
            torch.accelerator.synchronize()

        rows.emit("quant_prefill", variant=name, batch=batch, length=length,
                  seconds=_median_seconds(run, spec["iters"]))

    _each_variant(spec, rows, folder, ("bf16", "int8 activations+weights"), prefill)
    _forms(spec, rows, device, spec["batches"][0])


def write_random_checkpoint(model_type: str, config: dict, folder: str, seconds: float) -> int:
    """A bfloat16 safetensors checkpoint of a `model_type` model with random weights, written one decoder layer a
    file (the host holds one layer at a time: a 9B model's 18 GB never sit in its memory) with Transformers' index
    and config; raises TimeoutError past `seconds`. Each layer's weights are one random block per shape, scaled
    per layer (normal draws for 9B weights would take the host minutes); returns the bytes written."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM

    started = time.perf_counter()
    os.makedirs(folder, exist_ok=True)
    model_config = AutoConfig.for_model(model_type, **config)
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(model_config)
    shapes = {name: tuple(p.shape) for name, p in skeleton.named_parameters()}
    generator = torch.Generator().manual_seed(0)
    blocks = {}

    def block(shape):
        if shape not in blocks:
            drawn = torch.rand(shape, generator=generator, dtype=torch.float32)
            blocks[shape] = drawn.sub_(0.5).mul_(0.04).to(torch.bfloat16)
        return blocks[shape]

    files, index, written = {}, {}, 0
    for name, shape in shapes.items():
        layer = re.search(r"\.layers\.(\d+)\.", name)
        files.setdefault(f"layer-{int(layer.group(1)):03d}" if layer else "other", []).append(name)
    for part, names in sorted(files.items()):
        tensors = {}
        for name in names:
            shape = shapes[name]
            if name.endswith("norm.weight"):
                tensors[name] = torch.ones(shape, dtype=torch.bfloat16)
            else:
                tensors[name] = block(shape) * (1 + 0.01 * (len(tensors) % 7))
        filename = f"model-{part}.safetensors"
        save_file(tensors, os.path.join(folder, filename), metadata={"format": "pt"})
        written += sum(t.numel() * 2 for t in tensors.values())
        index.update({name: filename for name in names})
        del tensors
        if time.perf_counter() - started > seconds:
            raise TimeoutError(f"writing the checkpoint took over {seconds:.0f} s ({written / 1e9:.1f} GB written)")
    with open(os.path.join(folder, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": written}, "weight_map": index}, f)
    model_config.torch_dtype = "bfloat16"
    model_config.save_pretrained(folder)
    return written


def _device_peak() -> tuple:
    """(the allocator's peak bytes on tpu:0, the device's own peak where JAX reports one, else None)."""
    import torch

    from hf_tpu import platform

    stats = platform.devices()[0].memory_stats() or {}
    return torch.tpu.max_memory_allocated(0), stats.get("peak_bytes_in_use")


def group_quant_big(spec: dict, rows) -> None:
    import torch

    import hf_tpu  # noqa: F401
    from benchmarks.chip import _generate, _ids, _step_seconds, kv_bytes_per_token, measure_limits
    from benchmarks.common import jax_compile_phases
    from hf_tpu.integrations.transformers import configure

    measure_limits(spec, rows)
    configure(prompt_buckets=())  # the prompt's own length: one prefill program a model
    phases = jax_compile_phases()
    root = spec.get("quant_big_folder") or os.environ.get("HF_TPU_BENCH_CHECKPOINTS") or tempfile.gettempdir()
    for label, model_type, config in spec["quant_big"]:
        need = 1.1 * 2 * _parameters(model_type, config)  # its bfloat16 bytes
        free = shutil.disk_usage(root).free
        if free < need:
            rows.skip(label, f"needs ~{need / 1e9:.0f} GB of disk under {root} for its checkpoint, has "
                             f"{free / 1e9:.0f}")
            continue
        folder = tempfile.mkdtemp(prefix=f"hf-tpu-{label}-", dir=root)
        try:
            started = time.perf_counter()
            written = write_random_checkpoint(model_type, config, folder, spec["quant_big_write_seconds"])
            rows.emit("quant_written", model=label, bytes=written, seconds=time.perf_counter() - started)
            gc.collect()
            torch.tpu.reset_peak_memory_stats(0)
            compiled_before = sum(p.get("XLA", 0.0) for p in phases.values())
            started = time.perf_counter()
            from torchao.quantization import Int8WeightOnlyConfig

            model = _load(folder, Int8WeightOnlyConfig())
            torch.accelerator.synchronize()
            seconds = time.perf_counter() - started
            compile_seconds = sum(p.get("XLA", 0.0) for p in phases.values()) - compiled_before
            allocated, device_peak = _device_peak()
            held = torch.tpu.memory_allocated(0)
            rows.emit("quant_big_load", model=label, seconds=seconds, xla_compile=compile_seconds, bytes=written,
                      held=held, peak=allocated, device_peak=device_peak, step_bytes=step_bytes(model))
            generate = _generate(model)
            batch, prompt, steps = 1, spec["lengths"][0], spec["quant_steps"]
            ids = _ids(config["vocab_size"], batch, prompt).to("tpu")
            torch.tpu.reset_peak_memory_stats(0)
            step, first = _step_seconds(generate, ids, steps, 2)
            allocated, device_peak = _device_peak()
            cache = batch * (prompt + steps + 1) * kv_bytes_per_token(config)
            if step is None:
                rows.skip(f"{label} decode", "a decode step is below the timing noise")
            else:
                rows.emit("quant_big_decode", model=label, batch=batch, length=prompt, step_seconds=step,
                          first_call=first, context=prompt + steps // 2, step_bytes=step_bytes(model),
                          kv_bytes_per_token=kv_bytes_per_token(config), held=held, cache=cache,
                          peak=allocated, device_peak=device_peak)
            del model, generate
            gc.collect()
        except torch.OutOfMemoryError as e:
            rows.out_of_memory(label, e)
        except TimeoutError as e:
            rows.skip(label, str(e))
        finally:
            shutil.rmtree(folder, ignore_errors=True)


def _parameters(model_type: str, config: dict) -> float:
    """Parameters of a Llama- or Qwen3-shaped model (untied embedding and head)."""
    from benchmarks.chip import _layer_matmul_params

    return config["num_hidden_layers"] * _layer_matmul_params(config) + 2 * config["hidden_size"] * config["vocab_size"]


# --- Lines and tables


def describe(row: dict, hbm: float | None) -> str | None:
    """A quantization row as a line, or None for a row of another section."""
    section = row["section"]
    if section == "quant_forms":
        gbs = row["bytes"] / row["seconds"] / 1e9
        return (f"[quant] raw JAX weight products, {row['form']}, batch {row['batch']}: {row['seconds'] * 1e3:.3f} ms "
                f"({row['bytes'] / 1e6:.0f} MB held, {gbs:.0f} GB/s of them)")
    if section == "quant_load":
        return (f"[quant] {row['variant']}: loaded in {row['seconds']:.1f} s, {row['step_bytes'] / 1e9:.2f} GB read "
                "a step")
    if section in ("quant_decode", "quant_big_decode"):
        tokens = row["batch"] / row["step_seconds"]
        limit = _limit(row, hbm)
        what = row.get("variant") or f"{row['model']} int8"
        group = "quant" if section == "quant_decode" else "quant_big"
        extra = ""
        if section == "quant_big_decode":
            device = f", device peak {row['device_peak'] / 1e9:.2f} GB" if row.get("device_peak") else ""
            extra = (f", peak {row['peak'] / 1e9:.2f} GB ({row['peak'] / (row['held'] + row['cache']):.2f}x weights "
                     f"+ cache){device}")
        return (f"[{group}] {what} decode batch {row['batch']} after {row['length']}: {row['step_seconds'] * 1e3:.2f} "
                f"ms/step, {tokens:.0f} tokens/s" + (f" ({100 * tokens / limit:.0f}% of its bytes' HBM limit)"
                                                     if limit else "") + f", first call {row['first_call']:.1f} s"
                + extra)
    if section == "quant_prefill":
        return (f"[quant] {row['variant']} prefill {row['batch']}x{row['length']}: {row['seconds'] * 1e3:.2f} ms")
    if section == "quant_hlo":
        return (f"[quant] {row['variant']} {row['program']}: {row['products']} products, {row['int8_products']} of "
                f"int8 x int8, {row['fused_conversions']} reading their integer weight inside the product; "
                f"{row['written_dequantized']} dequantized weights written ({row['written_bytes'] / 1e6:.1f} MB)")
    if section == "quant_written":
        return (f"[quant_big] {row['model']}: {row['bytes'] / 1e9:.1f} GB bfloat16 checkpoint written in "
                f"{row['seconds']:.0f} s")
    if section == "quant_big_load":
        device = f", device peak {row['device_peak'] / 1e9:.2f} GB" if row.get("device_peak") else ""
        return (f"[quant_big] {row['model']}: loaded in int8 in {row['seconds']:.1f} s "
                f"({row['bytes'] / row['seconds'] / 1e9:.2f} GB/s of checkpoint; XLA compiles "
                f"{row['xla_compile']:.1f} s of it), {row['held'] / 1e9:.2f} GB held, "
                f"peak {row['peak'] / 1e9:.2f} GB ({row['peak'] / row['held']:.2f}x){device}")
    return None


def _limit(row: dict, hbm: float | None) -> float | None:
    """The HBM-bound tokens/s of a decode row: each step reads the weights it holds once, and the KV cache."""
    if not hbm:
        return None
    return row["batch"] * hbm / (row["step_bytes"] + row["batch"] * row["context"] * row["kv_bytes_per_token"])


def report(results: list, spec: dict, hbm: float | None) -> list:
    """The quantization tables: decode tokens/s per variant and batch beside bfloat16's, the prefill ratio."""
    from benchmarks.chip import _table

    out = []
    decode = [r for r in results if r["section"] == "quant_decode"]
    if decode:
        bf16 = {r["batch"]: r for r in decode if r["variant"] == "bf16"}
        rows = []
        for r in decode:
            tokens, limit = r["batch"] / r["step_seconds"], _limit(r, hbm)
            base = bf16.get(r["batch"])
            rows.append([r["variant"], r["batch"], f"{r['step_seconds'] * 1e3:.2f}", f"{tokens:.0f}",
                         f"{r['step_bytes'] / 1e9:.2f}", f"{limit:.0f}" if limit else "-",
                         f"{100 * tokens / limit:.0f}%" if limit else "-",
                         f"{base['step_seconds'] / r['step_seconds']:.2f}x" if base else "-"])
        out.append("quantized decode (the Llama model, prompt of "
                   f"{decode[0]['length']}; the limit: the bytes each reads a step at the HBM's bandwidth)")
        out.append(_table(["variant", "batch", "ms/step", "tokens/s", "GB a step", "HBM limit", "of limit",
                           "speed / bf16"], rows) + "\n")
    prefill = {r["variant"]: r for r in results if r["section"] == "quant_prefill"}
    if "bf16" in prefill and len(prefill) > 1:
        base = prefill["bf16"]["seconds"]
        out.append(_table(["prefill", "batch x len", "ms", "speed / bf16"],
                          [[name, f"{r['batch']}x{r['length']}", f"{r['seconds'] * 1e3:.2f}",
                            f"{base / r['seconds']:.2f}x"] for name, r in prefill.items()]) + "\n")
    forms = [r for r in results if r["section"] == "quant_forms"]
    if forms:
        base = {r["batch"]: r["seconds"] for r in forms if r["form"] == "bf16"}
        layers = forms[0]["layers"]
        out.append(f"the {layers} layer{'s' if layers != 1 else ''}' weight products alone in raw JAX, by the "
                   "weights' form")
        out.append(_table(["form", "batch", "ms", "MB held", "GB/s of them", "speed / bf16"],
                          [[r["form"], r["batch"], f"{r['seconds'] * 1e3:.3f}", f"{r['bytes'] / 1e6:.0f}",
                            f"{r['bytes'] / r['seconds'] / 1e9:.0f}",
                            f"{base[r['batch']] / r['seconds']:.2f}x" if r["batch"] in base else "-"]
                           for r in forms]) + "\n")
    decodes = {r["model"]: r for r in results if r["section"] == "quant_big_decode"}
    loads = [r for r in results if r["section"] == "quant_big_load"]
    if loads:
        rows = []
        for load in loads:
            r = decodes.get(load["model"])
            tokens, limit = (r["batch"] / r["step_seconds"], _limit(r, hbm)) if r else (None, None)
            rows.append([load["model"], f"{load['seconds']:.0f}", f"{load['bytes'] / load['seconds'] / 1e9:.2f}",
                         f"{load['held'] / 1e9:.2f}", f"{load['peak'] / load['held']:.2f}x",
                         f"{r['peak'] / (r['held'] + r['cache']):.2f}x" if r else "-",
                         f"{tokens:.1f}" if r else "-", f"{100 * tokens / limit:.0f}%" if limit else "-"])
        out.append("big models in int8 on one chip (random weights, loaded from a bfloat16 safetensors checkpoint)")
        out.append(_table(["model", "load s", "load GB/s", "GB held", "load peak / held",
                           "decode peak / (weights + cache)", "tokens/s", "of limit"], rows) + "\n")
    return out


if __name__ == "__main__":
    sys.exit("run through benchmarks.chip: python -m benchmarks.chip --only quant,quant_big")
