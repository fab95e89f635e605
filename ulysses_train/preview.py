"""`python -m ulysses_train.preview`: the command line of tools/preview.py."""

import sys

from .tools.preview import main

if __name__ == "__main__":
    sys.exit(main())
