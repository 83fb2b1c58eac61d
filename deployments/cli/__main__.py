"""`python -m deployments.cli`: the same as the `orca-serve` command."""
from __future__ import annotations

import sys

from deployments.cli.main import main

sys.exit(main())
