"""Errors the model runtime raises; each message names the file or value and what to change."""


class ModelLoadError(ValueError):
    """The model directory cannot be loaded as it is."""
