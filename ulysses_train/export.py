"""`python -m ulysses_train.export`: the command line of tools/export.py."""

import sys

from .tools.export import main

if __name__ == "__main__":
    sys.exit(main())
