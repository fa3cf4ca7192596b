"""Device memory: the buffers behind tpu tensors (`buffer`), PyTorch's storage APIs on tpu
(`storage_apis`), the DLPack capsule of a new storage (`_capsule.c`) and buffer donation (`donation`)."""
