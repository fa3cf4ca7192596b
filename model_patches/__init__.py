"""Per-architecture patches (shipped as `hf_tpu.model_patches`), chosen by a compatibility table."""
