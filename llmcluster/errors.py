"""The package's failures and every exit code, in one place.

`UserError` is bad input (a config, a flag, a file, unusable storage): one line on stderr, exit 2, never a
traceback. `RunFailure` is a run that failed at run time through no fault of its input (a hung or dead peer rank,
a node that failed its checks): one line, exit 1, or 75 when it checkpointed and asks to be requeued. The CLI turns
both into one line; anything else is a bug or an environment failure and keeps its traceback.
"""

EXIT_OK = 0
EXIT_FAILURE = 1        # the run failed, or a check FAILed (validate)
EXIT_USAGE = 2          # bad config, bad input, unusable storage
EXIT_DOES_NOT_FIT = 3   # `plan`: the plan's own layout does not fit in GPU memory (the reason on its first line)
EXIT_PREEMPTED = 75     # EX_TEMPFAIL: the run checkpointed on a signal; launchers requeue it
EXIT_FT_DROPPED = 76    # an ft replica group left the quorum as a straggler: started again after ft.straggler_backoff_s
EXIT_FT_NO_QUORUM = 77  # an ft group gave up waiting for a quorum (the others did not come): not its own failure
EXIT_INTERRUPTED = 130  # Ctrl-C (128 + SIGINT)


class _OneLine(Exception):
    def __init__(self, message: str, exit_code: int):
        super().__init__(message)
        self.exit_code = exit_code

    def __str__(self) -> str:  # one line, always
        return " ".join(str(self.args[0]).split())


class UserError(_OneLine):
    """Bad input: printed as one line, exit code 2."""

    def __init__(self, message: str, exit_code: int = EXIT_USAGE):
        super().__init__(message, exit_code)


class RunFailure(_OneLine):
    """A run that failed at run time (not its input): printed as one line, exit 1 (or EXIT_PREEMPTED)."""

    def __init__(self, message: str, exit_code: int = EXIT_FAILURE):
        super().__init__(message, exit_code)
