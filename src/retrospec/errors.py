"""User-facing errors: ``RetrospecError`` for anything a user can cause (bad paths, knobs or input, mismatched
tokenizers, corrupt stores); the CLI prints it as one line and exits 2. Programming errors stay ordinary exceptions.
"""


class RetrospecError(Exception):
    """An error caused by user input; its message is one line that says what to fix."""
