"""Structured (JSON lines) logging for every kvgate process."""

from __future__ import annotations

import logging
import re
import sys
from typing import Any

from pythonjsonlogger.json import JsonFormatter

_FORMAT = "%(asctime)s %(levelname)s %(name)s %(message)s"
# every attribute a bare LogRecord has (plus those a formatter or Python 3.12 adds): what is
# left on a record beyond these came from ``extra={...}``
_STANDARD_ATTRS = frozenset(logging.LogRecord("", 0, "", 0, "", (), None).__dict__) | {
    "message",
    "asctime",
    "taskName",
    "color_message",  # uvicorn's: the message again, with terminal colour codes
}
_BARE = re.compile(r"[\w.:/@+\-]+")
# the names ``--log-level`` and KVGATE_LOG_LEVEL take: logging itself also takes NOTSET
# (log everything, silently) and raises ValueError on anything else
LOG_LEVELS = ("CRITICAL", "ERROR", "WARNING", "INFO", "DEBUG")
# logging's own aliases: KVGATE_LOG_LEVEL=warn was taken by logging before it was checked,
# so a deployment that set it must keep starting
_LEVEL_ALIASES = {"WARN": "WARNING", "FATAL": "CRITICAL"}


class LogLevelError(ValueError):
    """An unknown log level name: ``kvgate`` prints it in one line and exits 2."""


def check_log_level(text: str) -> str:
    """``text`` as a known level name, upper case (any case given; logging's aliases warn
    and fatal as the names they stand for); else LogLevelError."""
    name = _LEVEL_ALIASES.get(text.upper(), text.upper())
    if name not in LOG_LEVELS:
        raise LogLevelError(f"unknown log level {text!r}; known: {', '.join(LOG_LEVELS)}")
    return name


def _value_text(value: Any) -> str:
    """A value as one token: a plain word stays bare, anything else (spaces, quotes, newlines,
    an empty string, a container) is its repr, so a line never splits or forges a field."""
    if isinstance(value, str):
        return value if _BARE.fullmatch(value) else repr(value)
    if value is None or isinstance(value, bool | int | float):
        return str(value)
    return repr(value)


class PlainFormatter(logging.Formatter):
    """The plain text line, followed by the record's structured fields as ``key=value``
    (in the order the call passed them): the fields the JSON formatter would carry."""

    def __init__(self) -> None:
        super().__init__(_FORMAT)

    def formatMessage(self, record: logging.LogRecord) -> str:
        text = super().formatMessage(record)
        extras = [
            f"{key}={_value_text(value)}"
            for key, value in record.__dict__.items()
            if key not in _STANDARD_ATTRS and not key.startswith("_")
        ]
        return f"{text} {' '.join(extras)}" if extras else text


def configure_logging(level: str = "INFO", json_format: bool = True) -> None:
    """Route the root logger to stderr, one JSON object per line (or plain text when
    ``json_format`` is false, for interactive use: the ``extra`` fields follow the message
    as ``key=value``). Pass fields with ``extra={...}``. An unknown ``level`` (a settings
    value no flag checked, e.g. KVGATE_LOG_LEVEL) raises LogLevelError before any change."""
    level = check_log_level(level)
    handler = logging.StreamHandler(sys.stderr)
    if json_format:
        handler.setFormatter(
            JsonFormatter(
                _FORMAT,
                rename_fields={"asctime": "ts", "levelname": "level", "name": "logger"},
            )
        )
    else:
        handler.setFormatter(PlainFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
    # uvicorn's access log is per request: far too chatty on a benchmark's hot path
    logging.getLogger("uvicorn.access").setLevel(logging.WARNING)
