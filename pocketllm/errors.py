"""Errors users see. Each message says what to change."""


class PocketLLMError(Exception):
    """Base class of every error PocketLLM raises on purpose."""


class ConfigurationError(PocketLLMError, ValueError):
    """An engine or request setting is invalid; raised before any weight is read."""


class UnsupportedFeatureError(PocketLLMError, NotImplementedError):
    """The model or configuration asks for something no runtime declares support for."""


class RequestError(PocketLLMError, ValueError):
    """A single request is invalid (too long, bad sampling parameters, ...)."""
