"""Hugging Face adapters (shipped as `hf_tpu.integrations`): they use the `tpu` device only through
its public contract (`torch.accelerator`, `torch.tpu`, `hf_tpu`'s public functions)."""
