"""``python -m leadgate``: the ``leadgate`` command."""

import sys

from leadgate.cli.main import main

sys.exit(main())
