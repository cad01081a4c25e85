"""``python -m failslow.cli``."""

import sys

from failslow.cli import main

sys.exit(main())
