"""``python -m deployments.cli``: the ``dsv4-serve`` command without its console script."""

import sys

from deployments.cli.main import main

sys.exit(main())
