"""The ``budgetq`` command line: thin wrappers over producer/, worker/ and simulator/."""
