"""Errors in a user's input files (prompts, eval sets, SFT data): `str(e)` is one line naming the
file and line (``path:line: reason``); `launch.py` prints it and exits 2 (1 is a bad config or
checkpoint, 0 success)."""

from __future__ import annotations

from typing import Any

__all__ = ["InputFileError", "render_chat"]


class InputFileError(ValueError):
    """A record of a user's file that does not fit (see the module docstring)."""


def render_chat(tok: Any, where: str, messages: list[dict], tools: list[dict] | None = None,
                add_generation_prompt: bool = False) -> str:
    """`tok.apply_chat_template(...)` as text; a record the template refuses (jinja's
    `raise_exception` on an unknown role, a missing jinja2) is an InputFileError naming `where`."""
    try:
        return tok.apply_chat_template(messages, tools=tools or None, tokenize=False,
                                       add_generation_prompt=add_generation_prompt)
    except Exception as e:  # jinja2 TemplateError / ImportError / TypeError: the record, not our code
        raise InputFileError(f"{where}: the chat template refuses this record ({type(e).__name__}: {e})") from None
