"""``python -m kvbench.report``: :func:`kvbench.report.main`."""

import sys

from kvbench.report import main

sys.exit(main())
