"""Errors that reach a user as one line and exit status 2, never as a traceback."""


class UserError(Exception):
    """Bad input from the user: wrong argument, missing file, unsupported combination."""
