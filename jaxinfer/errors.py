"""The errors jaxinfer raises for bad input. Each names the problem in words a user can act on;
none should surface as a traceback from deep inside JAX."""


class JaxinferError(Exception):
    """Base class of every error jaxinfer raises on purpose."""


class ConfigError(JaxinferError, ValueError):
    """An invalid or unsupported model/engine configuration."""


class ModelLoadError(JaxinferError):
    """A model file or directory that is missing, corrupt or of an unsupported kind."""


class InvalidRequestError(JaxinferError, ValueError):
    """A request the engine cannot serve: bad sampling parameter, empty or too-long prompt, ...

    `field` names the offending parameter, for the gRPC layer's INVALID_ARGUMENT messages."""

    def __init__(self, message: str, field: str | None = None):
        super().__init__(message)
        self.field = field


class InvalidTypeError(InvalidRequestError, TypeError):
    """An argument of the wrong type (also a TypeError); `field` names it."""


class EngineDeadError(JaxinferError, RuntimeError):
    """A step failed and the engine could not recover from it: it must be rebuilt."""


class QueueFullError(JaxinferError):
    """Too many requests are waiting to be scheduled; try again later."""


class DeadlineError(JaxinferError):
    """The engine predicts it cannot finish the request by its deadline, so it refused it
    (slo.py); try again later, elsewhere or with a longer deadline."""
