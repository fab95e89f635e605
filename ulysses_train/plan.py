"""`python -m ulysses_train.plan`: the command line of tools/plan.py."""

import sys

from .tools.plan import main

if __name__ == "__main__":
    sys.exit(main())
