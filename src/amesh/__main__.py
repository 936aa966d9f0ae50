"""``python -m amesh``: the ``amesh`` command."""

import sys

from ._cli import main

sys.exit(main())
