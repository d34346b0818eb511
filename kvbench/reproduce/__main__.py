"""``python -m kvbench.reproduce``: :func:`kvbench.reproduce.main`."""

import sys

from kvbench.reproduce import main

sys.exit(main())
