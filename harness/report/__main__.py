"""``python -m harness.report RUN_OR_SWEEP_DIRS...``: compare runs (see :mod:`harness.report.build`)."""

import sys

from harness.report.build import main

if __name__ == "__main__":
    sys.exit(main())
