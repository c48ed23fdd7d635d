"""``python -m budgetq``: the same as the ``budgetq`` command."""

import sys

from budgetq.cli.main import main

# main() returns the exit status: pass it on, as the console script does.
sys.exit(main())
