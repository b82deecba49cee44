"""``python -m onebit`` is the ``onebit`` command."""

import sys

from onebit.cli import main

sys.exit(main())
