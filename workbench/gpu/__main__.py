"""`python -m workbench.gpu pack | part | run | unpack | wheels` (see `workbench.gpu.cli`)."""

import sys

from .cli import main

sys.exit(main())
