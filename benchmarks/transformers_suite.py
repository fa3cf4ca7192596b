"""Transformers' own model tests on `cpu` and on `tpu`: `benchmarks/test_suite.py` for `--library transformers`.

Run: python -m benchmarks.transformers_suite --tests /tmp/tf_tests/tests/models/llama [more paths]
         [--jobs N] [-k EXPR] [--keep DIR] [--failures N]
"""

import functools

from . import test_suite
from .test_suite import compare, report  # noqa: F401  (this module's public API, as before the split)

LIBRARY = test_suite.LIBRARIES["transformers"]
DEVICE_ENVIRONMENTS = LIBRARY.device_environments
run_pytest = functools.partial(test_suite.run_pytest, library=LIBRARY)

if __name__ == "__main__":
    test_suite.main(library=LIBRARY)
