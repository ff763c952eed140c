"""`python -m hisparse_jax.serving [flags]` = `hisparse serve [flags]`."""

import sys

from hisparse_jax.cli import main

main(["serve", *sys.argv[1:]])
