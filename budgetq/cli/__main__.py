"""``python -m budgetq.cli``: the same as the ``budgetq`` command."""

import sys

from budgetq.cli.main import main

# main() returns the exit status (2 for a bad flag, 141 for a closed stdout): pass it on, as the
# console script does, or every error would exit 0.
sys.exit(main())
