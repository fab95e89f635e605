"""`python -m ulysses_train.long_range_demo`: the command line of tools/long_range_demo.py."""

import sys

from .tools.long_range_demo import main

if __name__ == "__main__":
    sys.exit(main())
