"""`python -m harness ...` is the same as `ring-harness ...`."""

import sys

from harness.commands.cli import main

sys.exit(main())
