"""Errors users see. Each message says what to change."""


class PocketLLMError(Exception):
    """Base class of every error PocketLLM raises on purpose."""


class ConfigurationError(PocketLLMError, ValueError):
    """An engine or request setting is invalid; raised before any weight is read."""


class DoesNotFitError(ConfigurationError):
    """The model cannot fit the device's memory: the memory plan's refusal, before any weight is read."""


class UnsupportedFeatureError(PocketLLMError, NotImplementedError):
    """The model or configuration asks for something no runtime declares support for."""


class RequestError(PocketLLMError, ValueError):
    """A single request is invalid (too long, bad sampling parameters, ...)."""


class RequestFailedError(PocketLLMError):
    """The engine failed while serving this request (a bug, isolated to the requests it touched)."""


class EngineDeadError(PocketLLMError):
    """The engine hit an error it cannot recover from; the process should be restarted."""
