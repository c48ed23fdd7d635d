"""The ``budgetq`` command line: thin wrappers over the library packages.

Nothing in the library imports it.
"""
