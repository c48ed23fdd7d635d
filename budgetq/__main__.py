"""``python -m budgetq``: the same as the ``budgetq`` command."""

from budgetq.cli.main import main

main()
