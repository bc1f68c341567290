"""``python -m irminsul.cli``: the ``irminsul`` command line."""

import sys

from . import main

sys.exit(main())
