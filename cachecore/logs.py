"""Structured (JSON lines) logging for every kvgate process."""

from __future__ import annotations

import logging
import sys

from pythonjsonlogger.json import JsonFormatter


def configure_logging(level: str = "INFO", json_format: bool = True) -> None:
    """Route the root logger to stderr, one JSON object per line (or plain text when
    ``json_format`` is false, for interactive use). Pass fields with ``extra={...}``."""
    handler = logging.StreamHandler(sys.stderr)
    if json_format:
        handler.setFormatter(
            JsonFormatter(
                "%(asctime)s %(levelname)s %(name)s %(message)s",
                rename_fields={"asctime": "ts", "levelname": "level", "name": "logger"},
            )
        )
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    # uvicorn's access log is per request: far too chatty on a benchmark's hot path
    logging.getLogger("uvicorn.access").setLevel(logging.WARNING)
