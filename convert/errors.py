class ConvertError(Exception):
    """A problem the user can fix; printed as one line, exit code 2."""
