"""Device memory: the buffers behind tpu tensors (`buffer`), PyTorch's storage APIs on tpu
(`storage_apis`), pinned host memory (`pinned`), the DLPack capsule of a new storage (`_capsule.c`),
buffer donation (`donation`) and XLA's out-of-memory error in PyTorch's terms (`out_of_memory`)."""
