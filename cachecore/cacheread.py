"""Which requests an engine serves without reading its prefix cache.

vLLM computes every prompt token of a request that asks for prompt logprobs (their logits
are the answer): ``SamplingParams`` sets ``skip_reading_prefix_cache`` when
``prompt_logprobs`` is not None, and the KV cache manager then returns no hit. Its OpenAI
server derives ``prompt_logprobs`` from ``echo`` when the field is absent: a chat takes
``top_logprobs`` (0 when absent, so ``echo: true`` alone is enough), a completion takes
``logprobs`` (none when absent). Such a request still caches the blocks it computes.

The gateway routes such a request by load and judges nothing by it: its ``cached_tokens``
of 0 says nothing about what the replica holds (taken as a lie, a tenant could quarantine
an honest replica for everyone), and the engine computes the whole prompt, which the
uncached-token budget must charge. The simulated replica serves it as vLLM does. One rule
for both, here.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pydantic import ValidationError

from cachecore.laxbool import lax_bool


def reads_prefix_cache(prompt_logprobs: object, echo: bool, echo_logprobs: object) -> bool:
    """vLLM's rule on parsed fields: ``echo_logprobs`` is the chat's ``top_logprobs`` or the
    completion's ``logprobs``, as the request model holds them (defaults applied)."""
    if prompt_logprobs is not None:
        return False
    return not (echo and echo_logprobs is not None)


def body_reads_prefix_cache(body: Mapping[str, Any], chat: bool) -> bool:
    """:func:`reads_prefix_cache` of a raw request body, its fields read as vLLM's request
    models read them (a lax bool for ``echo``; a value the engine refuses reads as not set:
    the request is refused before any prefill, so nothing is judged by it either way)."""
    value = body.get("echo")
    if value is None or value is False:
        echo = False  # nearly every request: no validator call
    else:
        try:
            echo = bool(lax_bool(value))
        except ValidationError:
            echo = False
    echo_logprobs = body.get("top_logprobs", 0) if chat else body.get("logprobs")
    return reads_prefix_cache(body.get("prompt_logprobs"), echo, echo_logprobs)
