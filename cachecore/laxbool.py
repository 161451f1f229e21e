"""A request's boolean field as vLLM's pydantic request models read it: pydantic's own lax
bool (python mode, as vLLM validates a JSON-decoded body): ``true`` / ``false``, the
numbers 0 and 1 (``1.0`` too), or one of its strings in any case (``"yes"``, ``"on"``,
``"t"``, ``"0"``...), no whitespace around it. One reader for the gateway's and the
simulated replica's fields, so that none writes pydantic's rule out again."""

from __future__ import annotations

from typing import Any

from pydantic import TypeAdapter

_OPTIONAL_BOOL = TypeAdapter(bool | None)  # immutable: a validator, no state


def lax_bool(value: Any) -> bool | None:
    """``value`` as pydantic's lax ``bool | None`` reads it (None stays None); pydantic's
    ValidationError (a ValueError) for anything else."""
    if value is None or value is True or value is False:  # nearly every field: no validator
        return value
    return _OPTIONAL_BOOL.validate_python(value)
