"""`hf-tpu env`: the platform, devices, versions, and every `HF_TPU_*` setting in force."""

from __future__ import annotations

import importlib.metadata


def _version(name: str) -> str:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def env_report() -> str:
    import jax
    import torch

    import hf_tpu
    from hf_tpu import settings
    from hf_tpu.integrations.transformers import settings as _generation_settings  # noqa: F401  (its variables)
    from hf_tpu.integrations import sentence_transformers as _encode_settings  # noqa: F401  (its variable)

    lines = [
        f"hf-tpu        {hf_tpu.__version__}",
        f"platform      {hf_tpu.platform_name()} (JAX default backend: {jax.default_backend()})",
        f"devices       {torch.tpu.device_count()}: "
        + ", ".join(f"tpu:{i} = {torch.tpu.get_device_properties(i).jax_device}" for i in range(torch.tpu.device_count())),
        f"device name   {torch.tpu.get_device_name()}",
        f"eager mode    {torch.tpu.eager_mode.name}" if hasattr(torch.tpu, "eager_mode") else "",
        f"accelerator   {torch.accelerator.current_accelerator()}",
    ]
    for pkg in ("torch", "jax", "jaxlib", "transformers", "diffusers", "accelerate", "safetensors"):
        lines.append(f"{pkg:<13} {_version(pkg)}")
    lines.append("\nsettings (environment variables; `default` where unset):")
    rows = settings.describe()
    for row in rows:
        value = "-" if row["value"] in ("", None) else row["value"]
        malformed = f"  MALFORMED: expected {row['accepted']}" if row["error"] else ""
        lines.append(f"  {row['name']:<32} {value!s:<24} {row['source']}{malformed}")
    malformed = [row["name"] for row in rows if row["error"]]
    if malformed:
        lines.append(f"\nmalformed: {', '.join(malformed)}. A program raises a ValueError naming each where it is read "
                     "(the core's at `import hf_tpu`); above, the defaults stood in for them.")
    return "\n".join(line for line in lines if line)


def run(args) -> int:
    """Prints the report; the status is 1 where a variable is malformed, since a program run in this
    environment fails at `import hf_tpu` (`hf-tpu env && python train.py` stops here)."""
    from hf_tpu import settings

    print(env_report())
    return 1 if any(row["error"] for row in settings.describe()) else 0
