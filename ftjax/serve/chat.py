"""Chat messages -> prompt token ids, with the checkpoint's chat template.

The template is the checkpoint's, found where transformers looks for it: ``chat_template.jinja``, then
``chat_template.json``, then ``tokenizer_config.json``'s ``chat_template`` (a string, or a list of
``{"name", "template"}`` of which "default" is used). It is rendered with jinja2 as transformers'
``apply_chat_template`` renders it: a sandboxed environment with ``trim_blocks`` and ``lstrip_blocks``,
the ``loopcontrols`` extension, the ``tojson`` filter, ``raise_exception`` and ``strftime_now``, the
tokenizer's special tokens (``bos_token``, ``eos_token``, ...) as variables and ``add_generation_prompt``
set; the text is then encoded without adding special tokens (the template writes them).

A checkpoint without one (the demo model, the test fixtures) gets the plain template: a line
``role: content`` per message and ``assistant:`` at the end, encoded as a completion prompt is.
"""

from __future__ import annotations

import datetime
import json
import os
from typing import Any, Sequence


class ChatTemplateError(ValueError):
    """Messages the template refuses (its ``raise_exception``), or a template that does not render."""


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise_exception(message):
    raise ChatTemplateError(message)


def _strftime_now(fmt):
    return datetime.datetime.now().strftime(fmt)


def _read_json(path: str) -> dict | None:
    if not os.path.isfile(path):
        return None
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _token_text(v) -> str | None:
    """A special token of tokenizer_config.json: a string, or an AddedToken dict with ``content``."""
    if isinstance(v, dict):
        return v.get("content")
    return v if isinstance(v, str) else None


class ChatTemplate:
    """Renders chat messages to prompt text and ids.

    Args:
      template: jinja2 source of a transformers chat template, or None for the plain template.
      special_tokens: variables the template sees (``bos_token``, ``eos_token``, ...), text each.
    Raises:
      ChatTemplateError: a template jinja2 cannot compile.
    """

    def __init__(self, template: str | None = None, special_tokens: dict[str, str] | None = None):
        self.source = template
        self.special_tokens = dict(special_tokens or {})
        self._compiled = None
        if template is not None:
            import jinja2
            import jinja2.ext
            from jinja2.sandbox import ImmutableSandboxedEnvironment
            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                extensions=[jinja2.ext.loopcontrols])
            env.filters["tojson"] = _tojson
            env.globals["raise_exception"] = _raise_exception
            env.globals["strftime_now"] = _strftime_now
            try:
                self._compiled = env.from_string(template)
            except jinja2.TemplateError as e:
                raise ChatTemplateError(f"chat template does not compile: {e}") from None

    @classmethod
    def from_checkpoint(cls, ckpt_dir: str | None) -> "ChatTemplate":
        """The chat template of the checkpoint in ``ckpt_dir`` (see the module docstring); the plain
        template when it has none (or ``ckpt_dir`` is None).
        Raises:
          ChatTemplateError: a template that does not compile; OSError, ValueError: unreadable files."""
        if not ckpt_dir:
            return cls()
        config = _read_json(os.path.join(ckpt_dir, "tokenizer_config.json")) or {}
        special = {k: t for k, v in config.items() if k.endswith("_token") and (t := _token_text(v)) is not None}
        template = None
        jinja_path = os.path.join(ckpt_dir, "chat_template.jinja")
        if os.path.isfile(jinja_path):
            with open(jinja_path, encoding="utf-8") as f:
                template = f.read()
        else:
            template = (_read_json(os.path.join(ckpt_dir, "chat_template.json")) or {}).get("chat_template")
            if template is None:
                template = config.get("chat_template")
        if isinstance(template, list):
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default")
        return cls(template if isinstance(template, str) else None, special)

    @property
    def is_plain(self) -> bool:
        """Whether this is the plain ``role: content`` template (the checkpoint has none)."""
        return self._compiled is None

    def render(self, messages: Sequence[dict[str, Any]]) -> str:
        """The prompt text of ``messages`` (dicts with ``role`` and ``content`` text), ending where the
        assistant's reply starts.
        Raises:
          ChatTemplateError: the template refused the messages or failed while rendering."""
        if self._compiled is None:
            return "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant:"
        import jinja2
        try:
            return self._compiled.render(messages=list(messages), add_generation_prompt=True, tools=None,
                                         documents=None, **self.special_tokens)
        except ChatTemplateError:
            raise
        except (jinja2.TemplateError, TypeError, ValueError, KeyError) as e:
            raise ChatTemplateError(f"chat template failed on these messages: {e}") from None

    def encode(self, tokenizer, messages: Sequence[dict[str, Any]]) -> list[int]:
        """Prompt token ids of ``messages`` (``tokenizer``: a ``tokenizers.Tokenizer``): the rendered text
        encoded without added special tokens, or, for the plain template, as a completion prompt.
        Raises:
          ChatTemplateError: as :meth:`render`."""
        text = self.render(messages)
        return tokenizer.encode(text, add_special_tokens=self.is_plain).ids
