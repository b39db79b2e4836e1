"""One error type for bad user input, and one formatter that turns it into one line.

Why: every command must answer a malformed file with a single line naming the
field and the value (``error: cluster.nodes[1].count: must be > 0, got 0``)
and exit code 2, never a traceback. Pydantic's ``ValidationError`` and our own
cross-field checks both end up here.
"""
from __future__ import annotations

import sys
from typing import Any, Optional, TextIO

import pydantic


MAX_FIELD_CHARS = 160  # a field path (a file name may be part of it)
MAX_MESSAGE_CHARS = 400  # the message; values inside it are echoed at most ~100 characters (``short``)


def short(value: Any, limit: int = 100) -> str:
    """``repr`` of a value, cut to ``limit`` characters: an error must never echo a huge input whole."""
    text = repr(value) if not isinstance(value, str) else repr(value[: limit + 1])
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _one_line(text: str, limit: int) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def print_error(message: str, stream: Optional[TextIO] = None) -> None:
    """Write ``error: <message>`` and its newline in ONE write, then flush.

    Why: the ranks of one launch share a single stderr pipe. ``print`` writes the text and the
    newline as two writes, and Python's stderr passes each straight through, so two ranks failing
    at once could glue their lines together (``...launched with 3error: ...``). One write of a
    short line (under PIPE_BUF, 4096 bytes on Linux) reaches the pipe whole.
    """
    stream = sys.stderr if stream is None else stream
    stream.write(f"error: {message}\n")
    stream.flush()


class InputError(ValueError):
    """Bad user input. ``str(err)`` is the one line shown to the user (without ``error:``): one line,
    bounded in length whatever the input."""

    def __init__(self, field: str, message: str):
        self.field = _one_line(field, MAX_FIELD_CHARS)
        self.message = _one_line(message, MAX_MESSAGE_CHARS)
        super().__init__(f"{self.field}: {self.message}" if self.field else self.message)


# the optional packages a command may need, by the setup.py extra that installs them
EXTRA_OF = {"torch": "runtime", "deepspeed": "runtime", "triton": "runtime", "matplotlib": "plot",
            "transformers": "hf", "megatron": "test"}


def missing_package(field: str, package: str) -> InputError:
    """One line naming the extra that brings ``package``. hethub installs from its checkout (it is on no
    package index), so the hint is the checkout's ``pip install -e ".[extra]"``."""
    extra = EXTRA_OF.get(package.split(".")[0], "runtime")
    return InputError(field, f"needs {package.split('.')[0]}, which this install lacks: pip install -e \".[{extra}]\" "
                             f"in hethub's checkout (or pip install \"hethub[{extra}] @ <path or URL of it>\")")


class InfeasibleError(InputError):
    """The input is well formed but no plan satisfies it (model does not fit, batch not divisible)."""


_CONSTRAINT_TEXT = {
    "greater_than": "must be > {gt}",
    "greater_than_equal": "must be >= {ge}",
    "less_than": "must be < {lt}",
    "less_than_equal": "must be <= {le}",
}


def _loc_to_path(loc: tuple[Any, ...]) -> str:
    path = ""
    for part in loc:
        if isinstance(part, int):
            path += f"[{part}]"
        else:
            path += ("." if path else "") + str(part)
    return path


def _join(*parts: str) -> str:
    out = ""
    for p in parts:
        if not p:
            continue
        out += p if (not out or p.startswith("[")) else (" " if out.endswith(":") else ".") + p
    return out


def from_validation_error(exc: pydantic.ValidationError, prefix: str) -> InputError:
    """First error of a pydantic ValidationError as an InputError with a dotted field path."""
    err = exc.errors(include_url=False)[0]
    # Union types add the tried member's name to loc (e.g. 'float', 'dict[str,float]'): drop those.
    loc = tuple(p for p in err["loc"] if not (isinstance(p, str) and ("[" in p or p in ("float", "int", "str"))))
    path = _join(prefix, _loc_to_path(loc))
    etype = err["type"]
    msg = err["msg"]
    if etype == "value_error":
        # Our own validators raise ValueError("field: message"); the field is relative to loc.
        text = str(err.get("ctx", {}).get("error", msg))
        if text.startswith("Value error, "):
            text = text[len("Value error, "):]
        field, sep, rest = text.partition(": ")
        if sep and " " not in field:
            return InputError(_join(path, field), rest)
        return InputError(path, text)
    if etype == "missing":
        return InputError(path, "is required")
    if etype == "extra_forbidden":
        return InputError(path, "unknown field")
    if etype in _CONSTRAINT_TEXT:
        ctx = {k: (int(v) if isinstance(v, float) and v.is_integer() else v) for k, v in err.get("ctx", {}).items()}
        text = _CONSTRAINT_TEXT[etype].format(**ctx)
        return InputError(path, f"{text}, got {short(err.get('input'))}")
    return InputError(path, f"{msg[0].lower() + msg[1:]}, got {short(err.get('input'))}")
