"""``python -m hacrl_fed.cli``: the ``hacrl-fed`` command line."""

import sys

from hacrl_fed.cli import main

sys.exit(main())
