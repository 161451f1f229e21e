"""An engine-tokenized chat with ``documents`` and a ``chat_template_kwargs`` that is no
object is the 400 naming it, as every other chat form's (it merged the documents into the
string and answered a 500)."""

from __future__ import annotations

import httpx
import pytest

from gateway.errors import GatewayError
from gateway.tokenization import EnginePromptTokenizer


async def test_documents_beside_non_object_kwargs_is_a_400() -> None:
    async with httpx.AsyncClient() as client:
        tok = EnginePromptTokenizer("tokenize", client, lambda _ids: None)
        body = {
            "messages": [{"role": "user", "content": "hi"}],
            "documents": [{"title": "a", "text": "b"}],
            "chat_template_kwargs": "x",
        }
        with pytest.raises(GatewayError) as got:
            await tok.chat(body, "salt")
    assert got.value.status == 400
    assert got.value.param == "chat_template_kwargs"
