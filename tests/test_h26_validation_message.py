"""Review R3's V7: pydantic's "Value error, " wrapping of a validator's words was stripped in
four places (the agent's, the gateway's and the replica's settings refusals, the policy
schema's), each its own copy. Now one helper, cachecore.argtypes.validation_message."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import BaseModel, ValidationError, field_validator

from cachecore.argtypes import validation_message

ROOT = Path(__file__).parents[1]


class _Model(BaseModel):
    x: int

    @field_validator("x")
    @classmethod
    def _positive(cls, v: int) -> int:
        if v <= 0:
            raise ValueError("must be positive, Value error, kept")
        return v


def test_it_strips_pydantics_wrapping_only() -> None:
    with pytest.raises(ValidationError) as exc:
        _Model(x=0)
    assert validation_message(exc.value.errors()[0]) == "must be positive, Value error, kept"
    with pytest.raises(ValidationError) as exc:
        _Model(x="a")  # type: ignore[arg-type]  # pydantic's own message, unwrapped
    assert validation_message(exc.value.errors()[0]).startswith("Input should be a valid integer")


def test_no_second_copy_of_the_strip() -> None:
    copies = [
        str(path.relative_to(ROOT))
        for package in ("cachecore", "gateway", "policies", "loadtest")
        for path in (ROOT / package).rglob("*.py")
        if 'removeprefix("Value error' in path.read_text()
        or "removeprefix('Value error" in path.read_text()
    ]
    assert copies == ["cachecore/argtypes.py"], copies
