"""The state every `tpu` call reads below the device face: the current device index (`current`) and
each device's random-number state (`rng`). `memory/`, `dispatch/`, `ops/` and the tracers import them;
`torch.tpu` (`hf_tpu.device`), above them all, is how a user reads and sets them."""
