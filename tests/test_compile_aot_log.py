"""`benchmarks.compile_aot` reads libtpu's log of a compile: its stages' seconds and the program's size (the
figures the chip's compile time tracks). A log's lines as libtpu 0.0.42 writes them, from the 1.1B's training
step at 2 layers compiled for a v5e on a host."""

import pytest

from benchmarks.compile_aot import _parse_compiler_log

LOG = """\
I1207 11:40:39.282577   27760 deepsea_compiler_hlo_passes.cc:6046] XLA::TPU running hlo passes for 3,946 instructions, module: jit_traced_step
I1207 11:40:39.287949   27760 deepsea_compiler_hlo_passes.cc:6091] Initial HLO module: jit_traced_step instructions: 3,946 fingerprint: 
I1207 11:40:39.498016   27760 deepsea_compiler_hlo_passes.cc:6154] HLO optimizing module: jit_traced_step instructions: 11,329
I1207 11:40:42.542236   27760 deepsea_compiler_hlo_passes.cc:6241] HLO_PASSES stage duration: 3.254286516s
I1207 11:42:16.036021   28347 deepsea_compiler_base.cc:3931] BACKEND_PASSES stage duration: 1m32.227576464s
I1207 11:42:19.596440   28347 deepsea_compiler_backend.cc:1773] final program bundle count: 774,327 note this count does not reflect cycles spent executing delays.
I1207 11:42:19.797896   28347 deepsea_compiler_backend.cc:1488] CODE_GENERATION stage duration: 3.76165220675s
I1207 11:42:20.454278   27760 deepsea_compiler_base.cc:985] END_TO_END stage duration: 1m41.2204860585s
"""


def test_stage_seconds_and_program_size_are_read_from_the_log():
    stages, size = _parse_compiler_log(LOG.splitlines())
    assert stages == pytest.approx({"HLO_PASSES": 3.254286516, "BACKEND_PASSES": 92.227576464,
                                    "CODE_GENERATION": 3.76165220675, "END_TO_END": 101.2204860585})
    assert size == {"instructions": 3946, "inlined instructions": 11329, "bundles": 774327}
