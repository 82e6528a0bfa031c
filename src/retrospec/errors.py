"""User-facing errors.

``RetrospecError`` is raised for anything a user can cause (bad paths, mismatched tokenizers, bad knobs, empty or
over-long input, corrupt stores). The CLI turns it into one line on stderr and exit code 2; library callers can
catch it. Programming errors stay ordinary exceptions with tracebacks.
"""


class RetrospecError(Exception):
    """An error caused by user input; its message is one line that says what to fix."""
