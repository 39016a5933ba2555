"""User-facing errors: one line, naming the file or flag at fault."""


class UserError(ValueError):
    """Bad input from the user (a file, a flag): the CLIs print the message alone and exit 1."""
