"""The plain text log line carries the structured fields the JSON line carries."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator

import pytest

from cachecore.logs import configure_logging


@pytest.fixture
def restore_root() -> Iterator[logging.Logger]:
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield root
    root.handlers[:] = handlers
    root.setLevel(level)


def test_plain_logs_append_the_extra_fields(
    restore_root: logging.Logger, capsys: pytest.CaptureFixture[str]
) -> None:
    configure_logging("INFO", json_format=False)
    log = logging.getLogger("kvgate.test")
    log.warning(
        "policy reload failed; keeping the old policy",
        extra={"field": "tenants.a.trust_group", "reason": "unknown group 'x'", "n": 3},
    )
    log.info("replica discovered", extra={"id": "r2", "url": "http://127.0.0.1:8001"})
    log.info("no fields")
    lines = capsys.readouterr().err.splitlines()
    assert lines[0].endswith(
        "WARNING kvgate.test policy reload failed; keeping the old policy "
        "field=tenants.a.trust_group reason=\"unknown group 'x'\" n=3"
    )
    assert lines[1].endswith("replica discovered id=r2 url=http://127.0.0.1:8001")
    assert lines[2].endswith("INFO kvgate.test no fields")


def test_plain_logs_quote_values_that_would_split_the_line(
    restore_root: logging.Logger, capsys: pytest.CaptureFixture[str]
) -> None:
    configure_logging("INFO", json_format=False)
    logging.getLogger("kvgate.test").info(
        "x", extra={"a": "two\nlines", "b": "", "c": ["l"], "d": None}
    )
    (line,) = capsys.readouterr().err.splitlines()
    assert line.endswith("x a='two\\nlines' b='' c=['l'] d=None")


def test_json_logs_are_unchanged(
    restore_root: logging.Logger, capsys: pytest.CaptureFixture[str]
) -> None:
    configure_logging("INFO", json_format=True)
    logging.getLogger("kvgate.test").info("replica discovered", extra={"id": "r2"})
    record = json.loads(capsys.readouterr().err)
    assert record["message"] == "replica discovered"
    assert record["id"] == "r2"
    assert record["level"] == "INFO" and record["logger"] == "kvgate.test"
