"""The one base class of problems the user can fix: the CLI prints them in one line, exit 2."""


class UserError(ValueError):
    """Bad input: a config value, a data file, a reward function, a command-line flag."""
