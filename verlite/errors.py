"""The one base class of problems the user can fix: the CLI prints them in one line, exit 2."""


class UserError(ValueError):
    """Bad input: a config value, a data file, a reward function, a command-line flag."""


class RunFailure(RuntimeError):
    """A run stopped for a reason its message names (a worker died, training diverged):
    the CLI prints it in one line and exits 1; checkpoints written so far stay valid."""
