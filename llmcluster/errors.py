"""The one exception type that means "the user gave us something we cannot use".

The CLI turns it into one line on stderr and exit code 2 (never a traceback). Everything else that goes
wrong is a bug or an environment failure and keeps its traceback.
"""

EXIT_USAGE = 2          # bad config, bad input, unusable storage
EXIT_PREEMPTED = 75     # EX_TEMPFAIL: the run checkpointed on a signal; launchers requeue it


class UserError(Exception):
    """Bad input: printed as one line, exit code 2."""

    def __init__(self, message: str, exit_code: int = EXIT_USAGE):
        super().__init__(message)
        self.exit_code = exit_code

    def __str__(self) -> str:  # one line, always
        return " ".join(str(self.args[0]).split())
