"""The errors of a limit configured so that it cannot work: apart from the limit's
settings, so that the procedure, its drivers and the request's limits raise them
without importing the settings."""

from __future__ import annotations

from bucketlimit import _errors


class ConfigurationError(_errors.ConfigurationError, RuntimeError):
    """The app configured a limit in a way that cannot work (raised while serving).

    A :class:`bucketlimit.ConfigurationError`, and a ``RuntimeError`` as it always was.
    """


class KeyFunctionError(ConfigurationError):
    """A key function returned no key: that would put every such request in one bucket."""


class LimitStringError(ValueError, TypeError):
    """A ``str`` given as a limit's limiter that is no limit string: a wrong value
    for a limit string (``ValueError``) and, as it always was, not a limiter
    (``TypeError``)."""
