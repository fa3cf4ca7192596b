"""Text to image on `tpu` with Diffusers: a tiny Stable Diffusion (or SD3, Flux, SDXL) pipeline built from
configs, saved, loaded back, moved with `pipe.to("tpu")`, and run; the image is saved as a PNG.

The weights are random (no Hub here), so the image is noise; what the example shows is the code path:
`from_pretrained` -> `pipe.to("tpu")` -> `pipe(prompt, generator=...)`, and that a CPU generator gives
the image the CPU gives.

Run: python examples/text_to_image.py [--pipeline sd|sd3|flux|sdxl] [--steps 3] [--compile] [--out text_to_image.png]
(the checkpoint is saved in a temporary folder removed once loaded; the image goes to --out)
"""

from __future__ import annotations

import argparse
import os
import tempfile

import torch


def tiny_tokenizer(max_length: int = 16):
    """A CLIP tokenizer over single bytes (no merges): enough to turn any prompt into ids."""
    from tokenizers.pre_tokenizers import ByteLevel
    from transformers import CLIPTokenizer

    symbols = sorted(ByteLevel.alphabet())
    vocab = {"<|startoftext|>": 0, "<|endoftext|>": 1}
    vocab.update({symbol: len(vocab) for symbol in symbols})
    vocab.update({symbol + "</w>": len(vocab) for symbol in symbols})
    return CLIPTokenizer(vocab=vocab, merges=[], model_max_length=max_length)


def _clip_config(projection_dim: int | None = None):
    from transformers import CLIPTextConfig

    extra = {"projection_dim": projection_dim} if projection_dim else {}
    return CLIPTextConfig(bos_token_id=0, eos_token_id=1, pad_token_id=1, hidden_size=16, intermediate_size=32,
                          num_attention_heads=2, num_hidden_layers=2, vocab_size=1000, max_position_embeddings=16,
                          **extra)


def tiny_stable_diffusion():
    """StableDiffusionPipeline: UNet on 8x8 latents, a VAE that halves 16x16 images, a 2-layer CLIP."""
    from diffusers import AutoencoderKL, DDIMScheduler, StableDiffusionPipeline, UNet2DConditionModel
    from transformers import CLIPTextModel

    torch.manual_seed(0)
    unet = UNet2DConditionModel(
        sample_size=8, in_channels=4, out_channels=4, block_out_channels=(8, 16), layers_per_block=1,
        down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"), up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
        cross_attention_dim=16, norm_num_groups=4, attention_head_dim=2,
    )
    vae = AutoencoderKL(
        sample_size=16, in_channels=3, out_channels=3, block_out_channels=(8, 16), latent_channels=4,
        down_block_types=("DownEncoderBlock2D",) * 2, up_block_types=("UpDecoderBlock2D",) * 2, norm_num_groups=4,
    )
    scheduler = DDIMScheduler(beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear", clip_sample=False,
                              set_alpha_to_one=False, steps_offset=1)
    return StableDiffusionPipeline(unet=unet, vae=vae, text_encoder=CLIPTextModel(_clip_config()),
                                   tokenizer=tiny_tokenizer(), scheduler=scheduler, safety_checker=None,
                                   feature_extractor=None, requires_safety_checker=False)


def tiny_sd3():
    """StableDiffusion3Pipeline (flow matching): a 1-layer SD3 transformer, two CLIP encoders, no T5."""
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel, StableDiffusion3Pipeline
    from transformers import CLIPTextModelWithProjection

    torch.manual_seed(0)
    transformer = SD3Transformer2DModel(
        sample_size=8, patch_size=1, in_channels=4, out_channels=4, num_layers=1, attention_head_dim=8,
        num_attention_heads=2, caption_projection_dim=16, joint_attention_dim=32, pooled_projection_dim=32,
        pos_embed_max_size=16,
    )
    vae = AutoencoderKL(
        sample_size=16, in_channels=3, out_channels=3, block_out_channels=(8, 16), latent_channels=4,
        down_block_types=("DownEncoderBlock2D",) * 2, up_block_types=("UpDecoderBlock2D",) * 2, norm_num_groups=4,
        use_quant_conv=False, use_post_quant_conv=False, shift_factor=0.0609, scaling_factor=1.5035,
    )
    return StableDiffusion3Pipeline(
        transformer=transformer, scheduler=FlowMatchEulerDiscreteScheduler(), vae=vae,
        text_encoder=CLIPTextModelWithProjection(_clip_config(projection_dim=16)), tokenizer=tiny_tokenizer(),
        text_encoder_2=CLIPTextModelWithProjection(_clip_config(projection_dim=16)), tokenizer_2=tiny_tokenizer(),
        text_encoder_3=None, tokenizer_3=None,
    )


def tiny_flux():
    """FluxPipeline: a Flux transformer with one double and one single block, CLIP and a 2-layer T5."""
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel
    from transformers import CLIPTextModel, T5Config, T5EncoderModel

    torch.manual_seed(0)
    transformer = FluxTransformer2DModel(
        patch_size=1, in_channels=4, num_layers=1, num_single_layers=1, attention_head_dim=16, num_attention_heads=2,
        joint_attention_dim=32, pooled_projection_dim=16, axes_dims_rope=[4, 4, 8],
    )
    vae = AutoencoderKL(
        sample_size=16, in_channels=3, out_channels=3, block_out_channels=(8, 16), latent_channels=1,
        down_block_types=("DownEncoderBlock2D",) * 2, up_block_types=("UpDecoderBlock2D",) * 2, norm_num_groups=4,
        use_quant_conv=False, use_post_quant_conv=False, shift_factor=0.0609, scaling_factor=1.5035,
    )
    t5 = T5EncoderModel(T5Config(vocab_size=1000, d_model=32, d_kv=8, d_ff=37, num_layers=2, num_heads=4,
                                 relative_attention_num_buckets=8, pad_token_id=1, eos_token_id=1))
    return FluxPipeline(scheduler=FlowMatchEulerDiscreteScheduler(), vae=vae, transformer=transformer,
                        text_encoder=CLIPTextModel(_clip_config()), tokenizer=tiny_tokenizer(),
                        text_encoder_2=t5, tokenizer_2=tiny_tokenizer())


def tiny_sdxl():
    """StableDiffusionXLPipeline: a UNet with SDXL's size and text-time conditioning, two CLIP encoders."""
    from diffusers import AutoencoderKL, EulerDiscreteScheduler, StableDiffusionXLPipeline, UNet2DConditionModel
    from transformers import CLIPTextModel, CLIPTextModelWithProjection

    torch.manual_seed(0)
    unet = UNet2DConditionModel(
        sample_size=8, in_channels=4, out_channels=4, block_out_channels=(4, 8), layers_per_block=1,
        down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"), up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
        attention_head_dim=(2, 4), use_linear_projection=True, addition_embed_type="text_time",
        addition_time_embed_dim=8, transformer_layers_per_block=(1, 2), projection_class_embeddings_input_dim=64,
        cross_attention_dim=32, norm_num_groups=1,
    )
    vae = AutoencoderKL(
        sample_size=16, in_channels=3, out_channels=3, block_out_channels=(8, 16), latent_channels=4,
        down_block_types=("DownEncoderBlock2D",) * 2, up_block_types=("UpDecoderBlock2D",) * 2, norm_num_groups=4,
    )
    return StableDiffusionXLPipeline(
        vae=vae, unet=unet, scheduler=EulerDiscreteScheduler(),
        text_encoder=CLIPTextModel(_clip_config()), tokenizer=tiny_tokenizer(),
        text_encoder_2=CLIPTextModelWithProjection(_clip_config(projection_dim=16)), tokenizer_2=tiny_tokenizer(),
    )


BUILDERS = {"sd": tiny_stable_diffusion, "sd3": tiny_sd3, "flux": tiny_flux, "sdxl": tiny_sdxl}
# components a tiny pipeline leaves out, which `from_pretrained` must be told are absent on purpose
ABSENT = {"sd3": ("text_encoder_3", "tokenizer_3")}
# every tiny pipeline makes 16x16 images; Flux pads its T5 prompt to 512 tokens unless told otherwise
CALL_ARGS = {kind: {"height": 16, "width": 16} for kind in BUILDERS}
CALL_ARGS["flux"]["max_sequence_length"] = 16


def saved_pipeline(kind: str, directory: str) -> str:
    """Builds the tiny pipeline `kind` and saves it under `directory`, as a checkpoint would be."""
    path = os.path.join(directory, f"tiny-{kind}")
    BUILDERS[kind]().save_pretrained(path)
    return path


def load(kind: str, path: str, **kwargs):
    from diffusers import DiffusionPipeline

    absent = {name: None for name in ABSENT.get(kind, ())}
    pipe = DiffusionPipeline.from_pretrained(path, **absent, **kwargs)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--pipeline", choices=sorted(BUILDERS), default="sd")
    p.add_argument("--prompt", default="a photo of a cat")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--compile", action="store_true", help="compile the denoiser and VAE decoder")
    p.add_argument("--out", default="text_to_image.png", help="PNG path (default: text_to_image.png here)")
    args = p.parse_args(argv)
    import hf_tpu  # here, not at the top: the builders above also serve processes without hf_tpu (torchax's)

    with tempfile.TemporaryDirectory() as directory:
        pipe = load(args.pipeline, saved_pipeline(args.pipeline, directory))
    pipe.to("tpu")
    if args.compile:
        from hf_tpu.integrations.diffusers import compile_pipeline

        compile_pipeline(pipe)
    generator = torch.Generator().manual_seed(args.seed)  # a CPU generator: the same noise as on CPU
    image = pipe(args.prompt, num_inference_steps=args.steps, generator=generator, **CALL_ARGS[args.pipeline]).images[0]

    out = args.out
    image.save(out)
    print(f"saved a {image.size[0]}x{image.size[1]} image to {out} ({args.pipeline}, {args.steps} steps on tpu)")
    print(hf_tpu.metrics())
    return out


if __name__ == "__main__":
    main()
