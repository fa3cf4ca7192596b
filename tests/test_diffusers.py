"""Diffusers pipelines on tpu against the same pipelines on CPU: the same image for each scheduler, no host
read per denoising step, compiled pipelines that compile nothing on a second call, Diffusers' own errors
for bad input, Diffusers' test-device tables, and the text-to-image example end to end.

Tiny pipelines (examples/text_to_image.py) are built, saved and loaded once per module; each call runs
2-3 denoising steps on 16x16 images.
"""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

import hf_tpu
from examples.text_to_image import CALL_ARGS, load, saved_pipeline
from hf_tpu.integrations.diffusers import compile_pipeline

ROOT = Path(__file__).resolve().parents[1]
ATOL = 1e-5  # float32 images in [0, 1]; measured differences are below 5e-7
PROMPT = "a photo of a cat"


@pytest.fixture(scope="module", autouse=True)
def _one_cpu_thread():
    """The CPU reference runs on one thread: on a shared 2-core machine, PyTorch's intra-op threads wait
    on each other and a tiny pipeline call takes seconds instead of milliseconds."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def sd_path(tmp_path_factory):
    return saved_pipeline("sd", str(tmp_path_factory.mktemp("diffusers")))


@pytest.fixture(scope="module")
def sd3_path(tmp_path_factory):
    return saved_pipeline("sd3", str(tmp_path_factory.mktemp("diffusers")))


@pytest.fixture(scope="module")
def sd(sd_path):
    return load("sd", sd_path), load("sd", sd_path).to("tpu")


@pytest.fixture(scope="module")
def sd3(sd3_path):
    return load("sd3", sd3_path), load("sd3", sd3_path).to("tpu")


def _generate(pipe, steps=3, seed=0, **kwargs):
    kwargs.setdefault("output_type", "np")
    return pipe(PROMPT, num_inference_steps=steps, generator=torch.Generator().manual_seed(seed), **kwargs).images


def _use_scheduler(pipes, name):
    import diffusers

    for pipe in pipes:
        pipe.scheduler = getattr(diffusers, name).from_config(pipe.scheduler.config)


SD_SCHEDULERS = ["DDIMScheduler", "EulerDiscreteScheduler", "EulerAncestralDiscreteScheduler",
                 "DPMSolverMultistepScheduler", "UniPCMultistepScheduler"]


@pytest.mark.parametrize("scheduler", SD_SCHEDULERS)
def test_stable_diffusion_same_image_as_cpu(sd, scheduler):
    _use_scheduler(sd, scheduler)
    cpu, tpu = sd
    np.testing.assert_allclose(_generate(tpu), _generate(cpu), atol=ATOL, rtol=0)


def test_sd3_flow_matching_same_image_as_cpu(sd3):
    cpu, tpu = sd3
    assert type(tpu.scheduler).__name__ == "FlowMatchEulerDiscreteScheduler"
    np.testing.assert_allclose(_generate(tpu), _generate(cpu), atol=ATOL, rtol=0)


def test_img2img_same_image_as_cpu(sd):
    from diffusers import StableDiffusionImg2ImgPipeline

    _use_scheduler(sd, "DDIMScheduler")
    cpu, tpu = (StableDiffusionImg2ImgPipeline(**pipe.components) for pipe in sd)
    image = torch.rand(1, 3, 16, 16, generator=torch.Generator().manual_seed(1))
    expected = _generate(cpu, steps=4, image=image, strength=0.6)
    np.testing.assert_allclose(_generate(tpu, steps=4, image=image, strength=0.6), expected, atol=ATOL, rtol=0)


@pytest.mark.parametrize("kind", ["flux", "sdxl"])
def test_flux_and_sdxl_same_image_as_cpu_eager_then_compiled(kind, tmp_path):
    """Two more families: Flux (T5 and CLIP encoders, packed latents) and SDXL (two CLIP encoders, one
    read through `hidden_states[-2]`). Run eagerly, then compiled, as a user prototypes and then deploys:
    an SDXL compiled after an eager call gave another image while its second encoder's hooks recorded
    each hidden state twice."""
    path = saved_pipeline(kind, str(tmp_path))
    cpu, tpu = load(kind, path), load(kind, path).to("tpu")
    expected = _generate(cpu, steps=2, **CALL_ARGS[kind])
    np.testing.assert_allclose(_generate(tpu, steps=2, **CALL_ARGS[kind]), expected, atol=ATOL, rtol=0)
    compile_pipeline(tpu)
    _generate(tpu, steps=2, **CALL_ARGS[kind])
    hf_tpu.reset_metrics()
    np.testing.assert_allclose(_generate(tpu, steps=2, **CALL_ARGS[kind]), expected, atol=ATOL, rtol=0)
    assert hf_tpu.metrics()["compiles"] == 0 and hf_tpu.metrics()["host_syncs"] == 1


@pytest.mark.slow  # batch 2: every op compiles anew (about 20 s)
def test_batch_with_a_generator_per_image(sd):
    _use_scheduler(sd, "EulerAncestralDiscreteScheduler")
    cpu, tpu = sd
    seeds = [torch.Generator().manual_seed(s) for s in (3, 4)], [torch.Generator().manual_seed(s) for s in (3, 4)]
    expected = cpu([PROMPT] * 2, num_inference_steps=2, generator=seeds[0], output_type="np").images
    actual = tpu([PROMPT] * 2, num_inference_steps=2, generator=seeds[1], output_type="np").images
    np.testing.assert_allclose(actual, expected, atol=ATOL, rtol=0)


def test_tpu_generator_draws_the_latents_on_tpu(sd):
    """`torch.Generator(device="tpu")`, the CUDA idiom with "tpu": the same seed gives the same image, and
    the latents come from the device's random numbers (a CPU generator's image is CPU's)."""
    _, tpu = sd

    def image(seed, device="tpu"):
        return tpu(PROMPT, num_inference_steps=2, generator=torch.Generator(device).manual_seed(seed),
                   output_type="np").images

    first = image(0)
    np.testing.assert_array_equal(image(0), first)
    assert not np.array_equal(image(1), first)
    assert not np.array_equal(image(0, "cpu"), first)


@pytest.mark.parametrize("scheduler", SD_SCHEDULERS)
def test_denoising_steps_read_nothing_back(sd, scheduler):
    """Host syncs do not grow with the number of steps (latent output: the image's own read-back is the
    caller's)."""
    _use_scheduler(sd, scheduler)
    tpu = sd[1]
    syncs = []
    for steps in (2, 5):
        hf_tpu.reset_metrics()
        _generate(tpu, steps=steps, output_type="latent")
        syncs.append(hf_tpu.metrics()["host_syncs"])
    assert syncs == [0, 0]


def test_flow_matching_steps_read_nothing_back(sd3):
    hf_tpu.reset_metrics()
    _generate(sd3[1], steps=4, output_type="latent")
    assert hf_tpu.metrics()["host_syncs"] == 0


def test_schedule_stays_on_the_host(sd):
    _use_scheduler(sd, "DPMSolverMultistepScheduler")
    scheduler = sd[1].scheduler
    scheduler.set_timesteps(4, device="tpu")
    assert scheduler.timesteps.device.type == "cpu" and scheduler.sigmas.device.type == "cpu"


def test_loaded_with_device_map_tpu(sd3, sd3_path):
    """A pipeline loaded straight onto tpu (no `pipe.to`) runs too: its denoiser is prepared when the
    pipeline first asks for its execution device."""
    tpu = load("sd3", sd3_path, device_map="tpu")
    assert tpu.transformer.device.type == "tpu"
    np.testing.assert_allclose(_generate(tpu, steps=2), _generate(sd3[0], steps=2), atol=ATOL, rtol=0)


@pytest.mark.parametrize("target", ["cpu", "tpu:1"])
def test_a_pipeline_moved_after_running_on_tpu_runs_where_it_went(sd3, sd3_path, target):
    """The denoiser's timestep upload follows the weights: it kept sending the timestep to the chip of
    the first call, so a pipeline moved to the CPU (or another chip) failed on two devices."""
    if target == "tpu:1" and torch.tpu.device_count() < 2:
        pytest.skip("needs two tpu chips")
    pipe = load("sd3", sd3_path).to("tpu")
    _generate(pipe, steps=2)
    pipe.to(target)
    assert pipe.transformer.device == torch.device(target)
    np.testing.assert_allclose(_generate(pipe, steps=2), _generate(sd3[0], steps=2), atol=ATOL, rtol=0)


@pytest.mark.parametrize("kind", [pytest.param("sd", marks=pytest.mark.slow), "sd3"])  # the UNet: 20 s
def test_compiled_pipeline_same_image_and_no_compiles_on_second_call(kind, sd_path, sd3_path, sd, sd3):
    cpu = {"sd": sd, "sd3": sd3}[kind][0]
    if kind == "sd":
        _use_scheduler([cpu], "DDIMScheduler")
    tpu = compile_pipeline(load(kind, {"sd": sd_path, "sd3": sd3_path}[kind]).to("tpu"))
    _use_scheduler([tpu], type(cpu.scheduler).__name__)
    first = _generate(tpu)
    hf_tpu.reset_metrics()
    second = _generate(tpu, seed=1, steps=4)  # another seed and step count: still the same graphs
    assert hf_tpu.metrics()["compiles"] == 0
    np.testing.assert_allclose(first, _generate(cpu), atol=ATOL, rtol=0)
    np.testing.assert_allclose(second, _generate(cpu, seed=1, steps=4), atol=ATOL, rtol=0)


def test_a_denoiser_compiled_as_users_compile_it_takes_the_timestep_on_its_chip(sd3_path, sd3):
    """`pipe.transformer = torch.compile(pipe.transformer, backend="tpu")`: an `OptimizedModule` in the pipeline,
    whose timestep hook reads the compiled module's signature; its calls are traced directly, without Dynamo."""
    import torch._dynamo.utils

    tpu = load("sd3", sd3_path).to("tpu")
    tpu.transformer = torch.compile(tpu.transformer, backend="tpu")
    torch._dynamo.utils.counters.clear()
    np.testing.assert_allclose(_generate(tpu, steps=2), _generate(sd3[0], steps=2), atol=ATOL, rtol=0)
    assert not torch._dynamo.utils.counters["frames"]


def test_compiled_pipeline_has_no_graph_breaks(sd3_path):
    """SD3's CLIP encoders are asked for hidden states: Transformers installs its capturing hooks on that
    first call, under a lock Dynamo cannot trace, unless compile_pipeline installed them before."""
    from torch._dynamo.utils import counters

    tpu = compile_pipeline(load("sd3", sd3_path).to("tpu"))
    counters.clear()
    _generate(tpu, steps=1)
    assert not counters["graph_break"], list(counters["graph_break"])


def test_compile_options_reach_torch_compile(sd3_path, sd3, monkeypatch):
    """A guard filter passed in `options` decides each compiled model's guards where Dynamo compiles it (here every
    model, the direct trace turned off); the image is unchanged."""
    monkeypatch.setenv("HF_TPU_COMPILE_DIRECT", "0")
    filtered = []

    def skip_module_guards(entries):
        filtered.append(len(entries))
        return torch.compiler.skip_guard_on_all_nn_modules_unsafe(entries)

    torch._dynamo.reset()  # graphs compiled by earlier tests for these classes would pass their guards here
    tpu = compile_pipeline(load("sd3", sd3_path).to("tpu"), options={"guard_filter_fn": skip_module_guards})
    image = _generate(tpu, steps=1)
    # every compiled frame, not only the first: the transformer, the VAE decoder, and the CLIP encoders'
    # forward (one class, same shapes: the second encoder passes the first one's guards, as without a filter)
    assert len(filtered) == 3
    np.testing.assert_allclose(image, _generate(sd3[0], steps=1), atol=ATOL, rtol=0)


def test_compile_pipeline_needs_the_pipeline_on_tpu(sd):
    with pytest.raises(ValueError, match=r"pipe.to\('tpu'\)"):
        compile_pipeline(sd[0])


@pytest.mark.slow  # bfloat16: every op compiles anew (about 30 s)
def test_bfloat16(sd, sd_path):
    _use_scheduler(sd, "DDIMScheduler")
    tpu = load("sd", sd_path).to("tpu", dtype=torch.bfloat16)
    assert tpu.unet.dtype == torch.bfloat16
    image = _generate(tpu)
    assert image.dtype == np.float32 and np.isfinite(image).all()
    np.testing.assert_allclose(image, _generate(sd[0]), atol=5e-2, rtol=0)


@pytest.mark.slow  # 32x32 images in a batch of 2: every op compiles anew
def test_attention_slicing_and_vae_tiling_and_slicing(sd):
    _use_scheduler(sd, "DDIMScheduler")
    try:
        for pipe in sd:
            pipe.enable_attention_slicing(1)
            pipe.vae.enable_tiling()  # tiles of the VAE's sample_size (16): a 32x32 image is decoded in 3x3
            pipe.vae.enable_slicing()
        cpu, tpu = sd
        seeds = [torch.Generator().manual_seed(s) for s in (0, 1)]
        expected = cpu([PROMPT] * 2, num_inference_steps=2, height=32, width=32, generator=seeds, output_type="np")
        seeds = [torch.Generator().manual_seed(s) for s in (0, 1)]
        actual = tpu([PROMPT] * 2, num_inference_steps=2, height=32, width=32, generator=seeds, output_type="np")
        np.testing.assert_allclose(actual.images, expected.images, atol=ATOL, rtol=0)
    finally:
        for pipe in sd:
            pipe.disable_attention_slicing()
            pipe.vae.disable_tiling()
            pipe.vae.disable_slicing()


@pytest.mark.parametrize("bad_input, error, message", [
    (dict(height=20, width=20), ValueError, "divisible by 8"),
    (dict(generator=[torch.Generator().manual_seed(0)] * 2), ValueError, "generators"),
    (dict(prompt_embeds=torch.zeros(1, 16, 16)), ValueError, "Cannot forward both"),
])
def test_bad_input_gives_diffusers_error(sd, bad_input, error, message):
    with pytest.raises(error, match=message):
        sd[1](PROMPT, num_inference_steps=2, **bad_input)


def test_missing_component_gives_diffusers_error(sd3_path):
    from diffusers import DiffusionPipeline

    with pytest.raises(ValueError, match="text_encoder_3"):
        DiffusionPipeline.from_pretrained(sd3_path, device_map="tpu")  # text_encoder_3=None left out


def test_diffusers_test_tables_for_tpu():
    """Run as Diffusers' own tests are: the env vars name the device and the backend, and Diffusers
    imports hf_tpu itself (so the adapter also installs with Diffusers imported first)."""
    code = textwrap.dedent("""
        import torch
        from diffusers.utils import testing_utils as tu
        from diffusers.utils.torch_utils import backend_device_count, backend_manual_seed
        from diffusers import DDIMScheduler

        assert tu.torch_device == "tpu"
        assert tu.BACKEND_DEVICE_COUNT["tpu"]() == backend_device_count("tpu") == 2
        tu.BACKEND_MANUAL_SEED["tpu"](7)
        first = torch.randn(3, device="tpu").cpu()
        backend_manual_seed("tpu", 7)
        assert torch.equal(first, torch.randn(3, device="tpu").cpu())
        tu.BACKEND_SYNCHRONIZE["tpu"]()
        tu.BACKEND_RESET_PEAK_MEMORY_STATS["tpu"]()
        assert tu.BACKEND_MAX_MEMORY_ALLOCATED["tpu"]() >= 0
        assert tu.BACKEND_SUPPORTS_TRAINING["tpu"] is True
        scheduler = DDIMScheduler()
        scheduler.set_timesteps(3, device="tpu")
        assert scheduler.timesteps.device.type == "cpu"
        print("ok")
    """)
    env = dict(os.environ, DIFFUSERS_TEST_DEVICE="tpu", DIFFUSERS_TEST_BACKEND="hf_tpu", HF_TPU_NUM_DEVICES="2")
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0 and result.stdout.strip().endswith("ok"), result.stderr[-3000:]


def _fresh_temp_dir(tmp_path) -> tuple[Path, dict]:
    """An empty folder for the temp dir, and the environment that points a process at it (PyTorch's own
    per-user compile cache, torchinductor_<user>, elsewhere: it is not the example's)."""
    temp_dir = tmp_path / "tmp"
    temp_dir.mkdir()
    return temp_dir, dict(os.environ, TMPDIR=str(temp_dir), TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "torch-cache"))


def test_text_to_image_example(tmp_path):
    """By default the image goes to the current folder, and nothing stays in the temp dir."""
    from PIL import Image

    temp_dir, env = _fresh_temp_dir(tmp_path)
    work = tmp_path / "work"
    work.mkdir()
    result = subprocess.run([sys.executable, str(ROOT / "examples" / "text_to_image.py")],
                            capture_output=True, text=True, timeout=300, cwd=work, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    assert Image.open(work / "text_to_image.png").size == (16, 16)
    assert list(temp_dir.iterdir()) == []
