"""`python -m hisparse_jax.cli ...` runs the `hisparse` command (where it is not
installed as a script, e.g. on the H200 for benchmarks/gpu_check.py)."""

import sys

from hisparse_jax.cli import main

sys.exit(main())
