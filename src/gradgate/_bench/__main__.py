"""``python -m gradgate._bench``: the benchmark without the ``gradgate`` command line."""

import sys

from . import main

sys.exit(main())
