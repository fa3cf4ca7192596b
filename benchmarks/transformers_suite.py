"""Transformers' own model tests on `cpu` and on `tpu`: `benchmarks/library_tests_on_tpu.py` for `--library transformers`.

Run: python -m benchmarks.transformers_suite --tests /tmp/tf_tests/tests/models/llama [more paths]
         [--jobs N] [-k EXPR] [--keep DIR] [--failures N]
"""

import functools

from . import library_tests_on_tpu
from .library_tests_on_tpu import compare, report  # noqa: F401  (part of this module's public API)

LIBRARY = library_tests_on_tpu.LIBRARIES["transformers"]
DEVICE_ENVIRONMENTS = LIBRARY.device_environments
run_pytest = functools.partial(library_tests_on_tpu.run_pytest, library=LIBRARY)

if __name__ == "__main__":
    library_tests_on_tpu.main(library=LIBRARY)
