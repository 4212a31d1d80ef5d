"""`python -m slimroute.cli`: the same commands as `slimroute`."""

import sys

from slimroute.cli import main

sys.exit(main())
