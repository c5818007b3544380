"""The one exception type for bad input: the CLI prints it as a single line and exits 2."""


class HarnessError(ValueError):
    """Bad input (case file, option, implementation name): the message names the problem."""
