"""`python -m hf_tpu.cli`, as the `hf-tpu` script."""

import sys

from . import main

sys.exit(main())
