"""``python -m precision.study FILE.py:TASK ...``: see precision.study._cli."""

import sys

from precision.study._cli import main

sys.exit(main())
