"""Review R-A of a3659da (a pool's engines' ``--default-chat-template-kwargs`` and
``--reasoning-effort-map``), checked against vLLM 0.33's source."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from cachecore.replica.settings import ReplicaSettings
from cachecore.tokenizer import ServerChatDefaults, TokenizerError
from policies.schema import PolicyError, parse_policy_text

pytestmark = pytest.mark.timeout(60)


def test_a_default_chat_template_is_refused_not_rendered_as_a_variable() -> None:
    # vLLM 0.33: ChatParams.get_apply_chat_template_kwargs lays {chat_template:
    # <--chat-template or None>} over the merged kwargs, merge_kwargs drops the None, and
    # renderers/hf.py safe_apply_chat_template takes the kwargs' chat_template as the
    # template itself (resolve_chat_template: "1st priority"). A server default
    # chat_template so renders every chat with another template, which the gateway (its
    # pool's tokenizer template, the key an unread variable) would key and charge wrong
    with pytest.raises(TokenizerError, match="chat_template"):
        ServerChatDefaults.of({"chat_template": "{{ messages[0].content }}"})
    with pytest.raises(PolicyError) as err:
        parse_policy_text(
            "models: {default: {default_chat_template_kwargs: {chat_template: 'x'}}}\n"
        )
    text = str(err.value)
    assert "models.default.default_chat_template_kwargs" in text, text
    assert "chat_template.jinja" in text, text  # says what to do instead
    with pytest.raises(ValidationError, match="chat_template"):
        ReplicaSettings(default_chat_template_kwargs={"chat_template": "x"})
    # a variable of any other name still is one
    assert ServerChatDefaults.of({"template_style": "x"}).under == {"template_style": "x"}


@pytest.mark.parametrize(
    ("kwargs", "vllm_text"),
    [
        ({"messages": 1}, "got multiple values for keyword argument 'messages'"),
        ({"self": 1}, "got multiple values for argument 'self'"),
        ({"return_assistant_tokens_mask": True}, "requires `return_dict=True`"),
    ],
)
def test_a_refusal_of_defaults_that_fail_every_chat_says_so(
    kwargs: dict[str, object], vllm_text: str
) -> None:
    # the text was vLLM's 400 alone ("jinja2.environment.Template.render() got multiple
    # values ..."), read at policy load with nothing saying that every chat would fail
    with pytest.raises(PolicyError) as err:
        parse_policy_text(
            "models: {default: {default_chat_template_kwargs: "
            + str(kwargs).replace("True", "true")
            + "}}\n"
        )
    text = str(err.value)
    assert vllm_text in text, text
    assert "vLLM refuses every chat with these defaults" in text, text
