"""Which content format a chat template takes, read off its Jinja AST as vLLM 0.33 reads it.

vLLM hands a template each message's ``content`` in one of two formats
(``--chat-template-content-format``): ``string``, the text parts joined into one string,
or ``openai``, a list of parts (``{"type": "text", "text": ...}``). Under ``auto`` (its
default) it detects the format from the template: ``openai`` when the template loops over
a message's content (``{% for item in message['content'] %}``, Gemma 3, Qwen2-VL, Llama 4
and Mistral's templates), else ``string``. The same template renders different text for
the two, so the gateway must render in the format the engine picked, or its keys and its
uncached-token charge are wrong (D34).

This module is vLLM 0.33's detector (``vllm/renderers/hf.py``: ``_detect_content_format``
and the AST walk of ``_iter_nodes_assign_content_item`` it calls), rule for rule; a
template it cannot parse, or whose walk fails (a loop over messages with a tuple target),
is ``string``, its default there.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from typing import Literal, get_args

import jinja2
import jinja2.nodes

ContentFormat = Literal["string", "openai"]
ContentFormatOption = Literal["auto", "string", "openai"]
CONTENT_FORMAT_OPTIONS: tuple[str, ...] = get_args(ContentFormatOption)


def detect_content_format(env: jinja2.Environment, source: str) -> ContentFormat:
    """``openai`` when the template ``source`` (parsed by ``env``, the environment it
    renders in) loops over a message's content, else ``string`` (vLLM 0.33's
    ``_detect_content_format(..., default="string")``)."""
    try:
        root = env.parse(source)
    except jinja2.TemplateError:
        return "string"
    try:
        next(_content_item_loops(root))
    except StopIteration:
        return "string"
    except Exception:  # vLLM: "Error when parsing AST", the default
        return "string"
    return "openai"


def resolve_content_format(option: str, detected: ContentFormat) -> ContentFormat:
    """The format rendered under ``option`` (vLLM's ``resolve_chat_template_content_format``):
    the detected one under ``auto``, else the operator's."""
    if option == "auto":
        return detected
    if option not in ("string", "openai"):
        raise ValueError(f"content format must be one of {', '.join(CONTENT_FORMAT_OPTIONS)}")
    return "openai" if option == "openai" else "string"


def _is_var_access(node: jinja2.nodes.Node, varname: str) -> bool:
    if isinstance(node, jinja2.nodes.Name):
        return bool(node.ctx == "load" and node.name == varname)
    # `ns.rest` matches the dotted alias "ns.rest"
    if isinstance(node, jinja2.nodes.Getattr) and "." in varname:
        base, _, attr = varname.rpartition(".")
        return bool(node.attr == attr) and _is_var_access(node.node, base)
    return False


def _is_attr_access(node: jinja2.nodes.Node, varname: str, key: str) -> bool:
    if isinstance(node, jinja2.nodes.Getitem):
        return (
            _is_var_access(node.node, varname)
            and isinstance(node.arg, jinja2.nodes.Const)
            and node.arg.value == key
        )
    if isinstance(node, jinja2.nodes.Getattr):
        return _is_var_access(node.node, varname) and node.attr == key
    return False


def _is_var_or_elems_access(node: jinja2.nodes.Node, varname: str, key: str | None = None) -> bool:
    if isinstance(node, jinja2.nodes.Filter):
        return node.node is not None and _is_var_or_elems_access(node.node, varname, key)
    if isinstance(node, jinja2.nodes.Test):
        return _is_var_or_elems_access(node.node, varname, key)
    if isinstance(node, jinja2.nodes.Getitem) and isinstance(node.arg, jinja2.nodes.Slice):
        return _is_var_or_elems_access(node.node, varname, key)
    return _is_attr_access(node, varname, key) if key else _is_var_access(node, varname)


def _attr_dotted_name(node: jinja2.nodes.Node) -> str | None:
    """An attribute-assignment target like ``ns.rest`` as a dotted name."""
    if isinstance(node, jinja2.nodes.NSRef):
        return f"{node.name}.{node.attr}"
    parts: list[str] = []
    while isinstance(node, jinja2.nodes.Getattr):
        parts.append(node.attr)
        node = node.node
    if isinstance(node, jinja2.nodes.Name):
        parts.append(node.name)
        return ".".join(reversed(parts))
    return None


def _aliases(root: jinja2.nodes.Node, varname: str) -> Iterator[str]:
    """``varname`` and every name assigned from it (or a slice or filter of it), through
    ``set`` and namespace attributes, transitively (vLLM's
    ``_iter_nodes_assign_var_or_elems``, a BFS over the template's assignments)."""
    yield varname
    seen = {varname}
    related = deque([varname])
    while related:
        name = related.popleft()
        for assign in root.find_all(jinja2.nodes.Assign):
            lhs, rhs = assign.target, assign.node
            if isinstance(lhs, jinja2.nodes.Name) and _is_var_or_elems_access(rhs, name):
                yield lhs.name
                if lhs.name != name and lhs.name not in seen:
                    seen.add(lhs.name)
                    related.append(lhs.name)
            # namespace aliases: `namespace(rest=messages)` or `ns.rest = messages`
            aliases: list[str] = []
            if (
                isinstance(lhs, jinja2.nodes.Name)
                and isinstance(rhs, jinja2.nodes.Call)
                and isinstance(rhs.node, jinja2.nodes.Name)
                and rhs.node.name == "namespace"
            ):
                aliases = [
                    f"{lhs.name}.{kwarg.key}"
                    for kwarg in rhs.kwargs
                    if _is_var_or_elems_access(kwarg.value, name)
                ]
            elif isinstance(
                lhs, (jinja2.nodes.Getattr, jinja2.nodes.NSRef)
            ) and _is_var_or_elems_access(rhs, name):
                dotted = _attr_dotted_name(lhs)
                aliases = [dotted] if dotted is not None else []
            for alias in aliases:
                yield alias
                if alias != name and alias not in seen:
                    seen.add(alias)
                    related.append(alias)


def _loop_name(loop: jinja2.nodes.For) -> str:
    # vLLM asserts a plain name: a tuple target fails the walk (the default format)
    target = loop.target
    if not isinstance(target, jinja2.nodes.Name):
        raise TypeError("loop target is not a name")
    return target.name


def _message_names(root: jinja2.nodes.Node) -> Iterator[str]:
    """The loop variables of every ``for`` over ``messages`` (or an alias of it)."""
    names = list(_aliases(root, "messages"))
    for loop in root.find_all(jinja2.nodes.For):
        if any(_is_var_or_elems_access(loop.iter, name) for name in names):
            yield _loop_name(loop)


def _content_item_loops(root: jinja2.nodes.Node) -> Iterator[str]:
    """The loops over a message's content (vLLM's ``_iter_nodes_assign_content_item``):
    ``for x in message['content']`` (``message`` a loop variable over the messages), a
    loop in a macro over the parameter a call passes ``message.content`` to, or a loop
    outside macros over a variable named ``content``."""
    messages = list(_message_names(root))
    # macro parameters that receive message.content as an argument
    params_by_loop: dict[int, set[str]] = {}
    in_macros: set[int] = set()
    for macro in root.find_all(jinja2.nodes.Macro):
        names = {arg.name for arg in macro.args}
        params: set[str] = set()
        for call in root.find_all(jinja2.nodes.Call):
            if not (isinstance(call.node, jinja2.nodes.Name) and call.node.name == macro.name):
                continue
            for i, arg in enumerate(call.args):
                if i < len(macro.args) and any(
                    _is_var_or_elems_access(arg, m, "content") for m in messages
                ):
                    params.add(macro.args[i].name)
            for kwarg in call.kwargs:
                if (
                    isinstance(kwarg, jinja2.nodes.Keyword)
                    and kwarg.key in names
                    and any(_is_var_or_elems_access(kwarg.value, m, "content") for m in messages)
                ):
                    params.add(kwarg.key)
        for loop in macro.find_all(jinja2.nodes.For):
            in_macros.add(id(loop))
            if params:
                params_by_loop[id(loop)] = params
    for loop in root.find_all(jinja2.nodes.For):
        it = loop.iter
        if any(_is_var_or_elems_access(it, m, "content") for m in messages):
            yield _loop_name(loop)
            continue
        params_here = params_by_loop.get(id(loop))
        if isinstance(it, jinja2.nodes.Name) and params_here is not None and it.name in params_here:
            yield _loop_name(loop)
            continue
        if id(loop) not in in_macros and isinstance(it, jinja2.nodes.Name) and it.name == "content":
            yield _loop_name(loop)
