"""User-facing errors: the CLI prints them as one line, the server maps them to OpenAI-shaped 4xx."""


class SpecServeError(Exception):
    """A problem the user can fix (bad input, missing file, unsupported model). Printed without traceback."""


class ModelLoadError(SpecServeError):
    """A model file or directory that cannot be loaded; the message names what and where."""


class InvalidRequestError(SpecServeError):
    """A request that can never be served as given (e.g. prompt longer than max_model_len)."""
