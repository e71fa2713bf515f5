"""``python -m lily``: the ``lily`` command."""
import sys

from .cli import main

sys.exit(main())
