"""`python -m harness ...` is the same as `ring-harness ...`."""

import sys

from harness.cli import main

sys.exit(main())
