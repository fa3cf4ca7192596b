"""Diffusers with its denoiser compiled as its users compile it, `pipe.transformer = torch.compile(pipe.transformer,
backend="tpu")` (or `pipe.unet`): the first image, the second, and the first and second at a second resolution,
against the same pipeline in strict eager and under torchax (where torchax is installed and runs it).

Two pipelines, their denoisers at real size with random weights: a Flux-shaped transformer of about 1B parameters
(`benchmarks.chip`'s: Flux's blocks at hidden 1536, 6 double- and 12 single-stream) and a UNet of Stable Diffusion
1.5's configuration (860M parameters), each with tiny text encoders and a small VAE (the denoiser is what is
compiled and timed; the rest runs in strict eager). Each (pipeline, side) runs in a process of its own, in a fresh
disk cache: a first image compiles what it compiles. Sides: `compiled` (the direct trace), `dynamo`
(HF_TPU_COMPILE_DIRECT=0: Dynamo's capture for every call), `eager` (no compile), `torchax`.

Run: python -m benchmarks.diffusers_compile                      (on a TPU: about 6 minutes)
     python -m benchmarks.diffusers_compile --size tiny --steps 2   (the same work at toy sizes, on the CPU)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

SIZES = {
    "1b": dict(flux=dict(num_layers=6, num_single_layers=12, attention_head_dim=128, num_attention_heads=12,
                         joint_attention_dim=4096, pooled_projection_dim=768, in_channels=64,
                         axes_dims_rope=[16, 56, 56]),
               unet=dict(sample_size=64, cross_attention_dim=768, attention_head_dim=8,
                         block_out_channels=(320, 640, 1280, 1280)),
               clip_hidden=768, t5_hidden=4096, text=512, resolutions=[(512, 512), (768, 768)]),
    "tiny": dict(flux=dict(num_layers=1, num_single_layers=1, attention_head_dim=16, num_attention_heads=2,
                           joint_attention_dim=32, pooled_projection_dim=16, in_channels=64, axes_dims_rope=[4, 6, 6]),
                 unet=dict(sample_size=8, cross_attention_dim=16, attention_head_dim=2, block_out_channels=(8, 16),
                           down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
                           up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"), layers_per_block=1, norm_num_groups=4),
                 clip_hidden=16, t5_hidden=32, text=16, resolutions=[(64, 64), (96, 96)]),
}
SIDES = ("compiled", "dynamo", "eager", "torchax")
PIPELINES = ("flux", "sd")


def _small_vae(latent_channels: int):
    """A VAE of Stable Diffusion's shape (8x downsampling) with few channels: its decode is a small part of an image."""
    from diffusers import AutoencoderKL

    return AutoencoderKL(in_channels=3, out_channels=3, block_out_channels=(8, 8, 8, 8),
                         latent_channels=latent_channels, down_block_types=("DownEncoderBlock2D",) * 4,
                         up_block_types=("UpDecoderBlock2D",) * 4, norm_num_groups=4, layers_per_block=1)


def _clip(hidden: int, length: int):
    from transformers import CLIPTextConfig, CLIPTextModel

    return CLIPTextModel(CLIPTextConfig(bos_token_id=0, eos_token_id=1, pad_token_id=1, hidden_size=hidden,
                                        intermediate_size=2 * hidden, num_attention_heads=2, num_hidden_layers=1,
                                        vocab_size=1000, max_position_embeddings=length, projection_dim=hidden))


def build(pipeline: str, size: dict):
    """The pipeline with random weights, on the CPU, in bfloat16."""
    import torch
    from diffusers import (DDIMScheduler, FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel,
                           StableDiffusionPipeline, UNet2DConditionModel)
    from transformers import T5Config, T5EncoderModel

    from examples.text_to_image import tiny_tokenizer

    torch.manual_seed(0)
    if pipeline == "flux":
        transformer = FluxTransformer2DModel(patch_size=1, guidance_embeds=True, **size["flux"])
        t5 = T5EncoderModel(T5Config(vocab_size=1000, d_model=size["t5_hidden"], d_kv=64, d_ff=256, num_layers=1,
                                     num_heads=4, relative_attention_num_buckets=8, pad_token_id=1, eos_token_id=1))
        pipe = FluxPipeline(scheduler=FlowMatchEulerDiscreteScheduler(), vae=_small_vae(16), transformer=transformer,
                            text_encoder=_clip(size["clip_hidden"], 77), tokenizer=tiny_tokenizer(77),
                            text_encoder_2=t5, tokenizer_2=tiny_tokenizer(size["text"]))
    else:
        unet = UNet2DConditionModel(in_channels=4, out_channels=4, **size["unet"])
        scheduler = DDIMScheduler(beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear",
                                  clip_sample=False, set_alpha_to_one=False, steps_offset=1)
        pipe = StableDiffusionPipeline(unet=unet, vae=_small_vae(4), text_encoder=_clip(size["clip_hidden"], 77),
                                       tokenizer=tiny_tokenizer(77), scheduler=scheduler, safety_checker=None,
                                       feature_extractor=None, requires_safety_checker=False)
    pipe.set_progress_bar_config(disable=True)
    return pipe.to(dtype=torch.bfloat16)


def _denoiser(pipeline: str) -> str:
    return "transformer" if pipeline == "flux" else "unet"


def _image(pipe, pipeline: str, size: dict, steps: int, height: int, width: int, synchronize):
    import torch

    kwargs = dict(max_sequence_length=size["text"]) if pipeline == "flux" else {}
    start = time.perf_counter()
    pipe("a photo of a cat", num_inference_steps=steps, height=height, width=width, output_type="latent",
         generator=torch.Generator().manual_seed(0), **kwargs)
    synchronize()
    return time.perf_counter() - start


def worker(pipeline: str, side: str, size_name: str, steps: int) -> None:
    """One pipeline on one side: prints a RESULT line per image."""
    size = SIZES[size_name]
    if side == "torchax":
        import torch
        import torchax

        pipe = build(pipeline, size)
        torchax.enable_globally()
        pipe.to("jax")
        name = _denoiser(pipeline)
        setattr(pipe, name, torchax.compile(getattr(pipe, name), torchax.CompileOptions(
            jax_jit_kwargs={"static_argnames": ("return_dict",)})))

        def synchronize():
            import jax

            jax.effects_barrier()
    else:
        import torch

        import hf_tpu  # noqa: F401

        pipe = build(pipeline, size).to("tpu")
        name = _denoiser(pipeline)
        if side in ("compiled", "dynamo"):
            setattr(pipe, name, torch.compile(getattr(pipe, name), backend="tpu"))
        synchronize = torch.accelerator.synchronize
    for height, width in size["resolutions"]:
        for image in ("first", "second"):
            seconds = _image(pipe, pipeline, size, steps, height, width, synchronize)
            print("RESULT " + json.dumps(dict(pipeline=pipeline, side=side, image=image, height=height, width=width,
                                              seconds=seconds)), flush=True)


def run(args) -> list:
    results = []
    cache = tempfile.mkdtemp(prefix="hf_tpu_diffusers_cache_")
    for pipeline in args.pipelines.split(","):
        for side in args.sides.split(","):
            env = dict(os.environ, PYTHONUNBUFFERED="1", HF_TPU_CACHE_DIR=os.path.join(cache, f"{pipeline}-{side}"))
            if side == "dynamo":
                env["HF_TPU_COMPILE_DIRECT"] = "0"
            command = [sys.executable, "-m", "benchmarks.diffusers_compile", "--worker", pipeline, side,
                       "--size", args.size, "--steps", str(args.steps)]
            try:
                proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=args.timeout)
            except subprocess.TimeoutExpired as e:
                out, reason = e.stdout or "", f"stopped after {args.timeout:.0f} s"
            else:
                out = proc.stdout
                reason = None if proc.returncode == 0 else _error(proc.stderr)
            if isinstance(out, bytes):
                out = out.decode()
            for line in out.splitlines():
                if line.startswith("RESULT "):
                    row = json.loads(line[len("RESULT "):])
                    results.append(row)
                    print(f"[{pipeline} {side}] {row['image']} image {row['height']}x{row['width']}: "
                          f"{row['seconds']:.2f} s", flush=True)
            if reason:
                results.append(dict(pipeline=pipeline, side=side, skipped=reason))
                print(f"[{pipeline} {side}] skipped: {reason}", flush=True)
    return results


def _error(stderr: str) -> str:
    """The last line of a process's error output naming an error (Dynamo's advice lines come after it)."""
    lines = [line for line in stderr.strip().splitlines() if "Error" in line or "Exception" in line]
    return (lines or stderr.strip().splitlines() or ["?"])[-1][:300]


def report(results: list) -> str:
    lines = ["seconds per image (output_type='latent'; the denoiser's steps, the text encoders, no VAE decode)",
             f"{'pipeline':9} {'side':9} " + " ".join(f"{'resolution':>11} {'first':>8} {'second':>8}" for _ in (0,))]
    for row in results:
        if "skipped" in row:
            lines.append(f"{row['pipeline']:9} {row['side']:9} skipped: {row['skipped']}")
    by = {}
    for row in results:
        if "seconds" in row:
            key = (row["pipeline"], row["side"], row["height"], row["width"])
            by.setdefault(key, {})[row["image"]] = row["seconds"]
    for (pipeline, side, height, width), images in by.items():
        lines.append(f"{pipeline:9} {side:9} {f'{height}x{width}':>11} {images.get('first', 0):8.2f} "
                     f"{images.get('second', 0):8.2f}")
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="1b")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--pipelines", default=",".join(PIPELINES))
    parser.add_argument("--sides", default=",".join(SIDES))
    parser.add_argument("--timeout", type=float, default=300, help="seconds each (pipeline, side) may take")
    parser.add_argument("--worker", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        return worker(*args.worker, args.size, args.steps)
    print("\n" + report(run(args)))


if __name__ == "__main__":
    main()
