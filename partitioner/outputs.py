"""Writing what a command produces: atomically, and never over one of the command's own inputs.

Why: a failed or interrupted write must leave the previous file (or none), never a truncated one, and
``hethub plan -o cluster.yaml`` must not destroy the cluster it was planning for. The text is written to
a temporary file in the target's directory, flushed to disk, then renamed over the target (atomic on
POSIX); any failure removes the temporary file and becomes one InputError naming the flag.
"""
from __future__ import annotations

import os
import tempfile
from typing import Callable, Iterable, Optional

from .errors import InputError


def check_output_path(path: str, flag: str, inputs: Iterable[Optional[str]] = ()) -> None:
    """Refuse a directory, a missing folder, or a path that is one of ``inputs`` (same file)."""
    if not path:
        raise InputError(flag, "empty path")
    if os.path.isdir(path):
        raise InputError(flag, f"{path!r} is a directory; give a file name")
    if os.path.exists(path) and not os.path.isfile(path):
        raise InputError(flag, f"{path!r} is not a regular file (a device or pipe); give a file name")
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise InputError(flag, f"folder {folder!r} does not exist")
    target = os.path.realpath(path)
    for src in inputs:
        if src and os.path.exists(src) and os.path.realpath(src) == target:
            raise InputError(flag, f"{path!r} is an input of this command; write the output elsewhere")


def write_atomic(path: str, text_or_writer, flag: str, inputs: Iterable[Optional[str]] = ()) -> None:
    """Write ``text_or_writer`` (a str, or a callable taking a temporary path and writing it) to ``path``."""
    check_output_path(path, flag, inputs)
    folder = os.path.dirname(os.path.abspath(path))
    suffix = os.path.splitext(path)[1]  # writers such as matplotlib pick the format from the extension
    fd, tmp = tempfile.mkstemp(prefix=".hethub-", suffix=suffix, dir=folder)
    try:
        if callable(text_or_writer):
            os.close(fd)
            fd = -1
            _call_writer(text_or_writer, tmp)
        else:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                fd = -1
                f.write(text_or_writer)
                f.flush()
                os.fsync(f.fileno())
        os.chmod(tmp, _file_mode())
        os.replace(tmp, path)
    except OSError as exc:
        raise InputError(flag, f"cannot write {path!r}: {exc.strerror or exc}") from None
    finally:
        if fd >= 0:
            os.close(fd)
        if os.path.exists(tmp):
            os.unlink(tmp)


def _file_mode() -> int:
    """The mode ``open()`` would give a new file (0666 less the umask): mkstemp's 0600 would make a plan
    unreadable to the other users and services of a shared cluster that launch from it."""
    umask = os.umask(0)
    os.umask(umask)
    return 0o666 & ~umask


def _call_writer(writer: Callable[[str], None], tmp: str) -> None:
    writer(tmp)
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())


def num(x: float) -> str:
    """A number as people read it in a summary: 16,520 and 1.909, never 1.652e+04."""
    if abs(x) >= 1000:
        return f"{x:,.0f}"
    if abs(x) >= 100:
        return f"{x:.1f}"
    return f"{x:.4g}" if abs(x) >= 1e-3 or x == 0 else f"{x:.2e}"


def count(n: int, noun: str) -> str:
    """``1 stage``, ``3 stages``: what users read in titles and summaries."""
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"
