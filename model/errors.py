"""Errors the command line turns into one-line messages instead of tracebacks."""


class ModelLoadError(Exception):
    """A model file or directory cannot be read: missing, corrupt, or of an architecture we do not run."""
