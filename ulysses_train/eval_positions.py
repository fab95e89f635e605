"""`python -m ulysses_train.eval_positions`: the command line of tools/eval_positions.py."""

import sys

from .tools.eval_positions import main

if __name__ == "__main__":
    sys.exit(main())
