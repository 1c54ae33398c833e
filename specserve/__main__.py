"""``python -m specserve``: the same as the ``specserve`` command."""

import sys

from specserve.cli import main

sys.exit(main())
