"""Chat templates: a conversation (a list of ``{"role", "content"}`` messages) turned into the text
a chat model was trained on, rendered exactly as ``transformers``' ``apply_chat_template`` renders it.

The template is Jinja: ``tokenizer_config.json``'s ``chat_template``, a folder's
``chat_template.jinja``, or a GGUF file's ``tokenizer.chat_template``. It is rendered in Jinja's
immutable sandbox (a template cannot reach Python's internals) with ``transformers``' settings and
extras: ``trim_blocks`` and ``lstrip_blocks``, the loop controls (``{% break %}``), a ``{% generation
%}`` block that renders its body, the ``tojson`` filter without HTML escaping, and the globals
``raise_exception(message)`` and ``strftime_now(format)``; the variables are ``messages``,
``add_generation_prompt``, ``tools``, ``documents`` and the special tokens (``bos_token``,
``eos_token``, ...).
"""
from __future__ import annotations

import json
import re
from datetime import datetime

from selfattn._util.validate import one_line, short_json

ROLES = ("system", "user", "assistant")  # every chat template writes these
EXTRA_ROLES = ("tool", "developer", "ipython")  # roles some templates write: known to one that names it


def text_messages(messages) -> list[dict]:
    """``messages`` as a template reads them, each ``{"role": str, "content": str, ...}`` (other keys
    kept): a content given as a list of text parts (OpenAI's ``[{"type": "text", "text": ...}]``)
    joined into one string.

    Raises ``ValueError`` naming the message (1-based) that is not an object, has no string role, no
    content, or a part that is not text."""
    if not isinstance(messages, list) or not messages:
        raise ValueError(f"messages must be a non-empty list, got {short_json(messages)}")
    out = []
    for k, m in enumerate(messages, 1):
        if not (isinstance(m, dict) and isinstance(m.get("role"), str)):
            raise ValueError(f"message {k} must be an object with a string \"role\", got {short_json(m)}")
        content = m.get("content")
        if isinstance(content, list):
            for j, part in enumerate(content, 1):
                if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                    kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                    raise ValueError(f"message {k}: content part {j} is of type {kind!r}; only text parts "
                                     f"({{\"type\": \"text\", \"text\": ...}}) are read")
            content = "".join(part["text"] for part in content)
        if not isinstance(content, str):
            raise ValueError(f"message {k} must have a \"content\": a string or a list of text parts, got "
                             f"{short_json(m)}")
        out.append({**m, "content": content})
    return out


class ChatTemplate:
    """A chat template, compiled at its first use; :meth:`render` writes a conversation with it.

    ``tokens``: the special tokens the template may name, ``{"bos_token": "<s>", ...}``; ``where``:
    the file it came from, named in errors.
    """

    def __init__(self, source: str, tokens: dict[str, str], where: str):
        if not isinstance(source, str) or not source:
            raise ValueError(f"{where}: the chat template must be a non-empty string, got {source!r}")
        self.source, self.tokens, self.where = source, dict(tokens), where
        self._template = None  # compiled on first use: loading a model never needs jinja2
        # the roles it writes: every template's, and each extra one its source names in quotes
        self.roles = ROLES + tuple(r for r in EXTRA_ROLES if re.search(f"[\"']{r}[\"']", source))

    def render(self, messages: list[dict], *, add_generation_prompt: bool = True, **extra) -> str:
        """The text of ``messages``; with ``add_generation_prompt``, followed by what starts the
        assistant's answer. ``extra`` variables (``tools``, ``documents``, ...) reach the template.
        A message whose role the template does not write (:attr:`roles`), or a template that refuses
        the conversation (``raise_exception``), is a ValueError saying why."""
        if not (isinstance(messages, list) and all(isinstance(m, dict) and "role" in m for m in messages)):
            raise TypeError(f"messages must be a list of dicts with a 'role', got {messages!r}")
        for k, m in enumerate(messages, 1):
            if m["role"] not in self.roles:
                raise ValueError(f"message {k} has the role {m['role']!r}, which this model's chat template does "
                                 f"not write (its roles: {', '.join(self.roles)})")
        jinja2 = _import_jinja2()
        if self._template is None:
            try:
                self._template = _environment().from_string(self.source)
            except jinja2.TemplateError as e:
                raise ValueError(f"{self.where}: the chat template is not valid Jinja ({one_line(e)})") from None
        try:
            return self._template.render(messages=messages, tools=extra.pop("tools", None),
                                         documents=extra.pop("documents", None),
                                         add_generation_prompt=add_generation_prompt, **self.tokens, **extra)
        except jinja2.TemplateError as e:
            raise ValueError(f"{self.where}: the chat template refused the conversation ({one_line(e)})") from None


def _environment():
    """Jinja's immutable sandbox set up as ``transformers`` sets it up for chat templates."""
    jinja2 = _import_jinja2()
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(Extension):  # {% generation %}...{% endgeneration %}: marks the assistant's text; renders it
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[Generation, loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


def _import_jinja2():
    try:
        import jinja2
        import jinja2.ext
        import jinja2.sandbox
    except ImportError as e:
        raise ImportError("chat templates need the 'jinja2' package: pip install 'selfattn[train]'") from e
    return jinja2
