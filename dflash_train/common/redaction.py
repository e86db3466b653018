"""Secrets in URLs never reach output: the one redaction used by every message, reason and log line.

A URL may carry credentials (`redis://:pw@host`, `s3://KEY:SECRET@bucket/...`,
`...?password=pw`). `redact_url` masks them in one URL; `redact` masks every URL inside
any text (an error message, a traceback, a JSON document). The edges apply `redact`:
the `dflash-eval` command line wraps its stdout and stderr (`redacted_output`), every log
record of a process that calls `install_log_redaction` is redacted when it is made (so every
handler, RQ's included, writes it redacted), and the worker redacts the failure text RQ stores.
Messages built with `redact`/`redact_url` stay readable: the user name and host are kept.
"""
from __future__ import annotations

import contextlib
import io
import logging
import re
import sys
from collections.abc import Iterator
from typing import overload
from urllib.parse import urlsplit

__all__ = ["redact", "redact_url", "redacted_output", "install_log_redaction"]

_SECRET_QUERY_KEYS = ("password", "pass", "pwd", "secret", "token", "ssl_password")
_SECRET_QUERY_RE = re.compile(
    r"(^|[&;])(" + "|".join(_SECRET_QUERY_KEYS) + r")=([^&;#]*)", re.IGNORECASE
)
_MASK = "***"
# a URL inside text: scheme://, then up to whitespace, a quote or a bracket that ends it in prose/JSON/repr
# `scheme://[...@]...`: brackets around the userinfo mark an optional part of a syntax, never a real URL's
# (a bracket is only valid around an IPv6 host, which holds no `@`)
_TEMPLATE = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://\[[^\]/@]*@\]")
_URL_IN_TEXT = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://[^\s'\"<>`]+")


@overload
def redact_url(url: str) -> str: ...
@overload
def redact_url(url: None) -> None: ...
@overload
def redact_url(url: str | None) -> str | None: ...
def redact_url(url: str | None) -> str | None:
    """Return ``url`` with any password replaced by ``***``.

    ``redis://user:pw@host:6379/0`` -> ``redis://user:***@host:6379/0``;
    ``redis://:pw@host`` -> ``redis://:***@host``; a lone userinfo
    (``redis://pw@host``, a common way to write a bare password) is masked too;
    ``?password=...`` query values are masked. Never raises.
    """
    if not url:
        return url
    if _TEMPLATE.match(url):  # a syntax template (`redis://[:password@]host`, help text), not a URL: no secret
        return url
    try:
        parts = urlsplit(url)
        out = url
        netloc = parts.netloc
        if "@" in netloc:
            userinfo, hostport = netloc.rsplit("@", 1)
            if ":" in userinfo:
                userinfo = userinfo.split(":", 1)[0] + ":" + _MASK
            elif userinfo:
                userinfo = _MASK
            out = out.replace("//" + netloc, "//" + f"{userinfo}@{hostport}", 1)
        if "?" in out:
            head, _, query = out.partition("?")
            query = _SECRET_QUERY_RE.sub(lambda m: f"{m.group(1)}{m.group(2)}={_MASK}", query)
            out = f"{head}?{query}"
        return out
    except Exception:  # noqa: BLE001 - malformed URL: fall back to a blunt regex, never leak
        masked = re.sub(r"//[^/@]*@", f"//{_MASK}@", url)
        return _SECRET_QUERY_RE.sub(lambda m: f"{m.group(1)}{m.group(2)}={_MASK}", masked)


def redact(text) -> str:
    """`text` (anything; str() of it) with the credentials of every URL in it masked (`redact_url`)."""
    text = str(text)
    if "://" not in text:
        return text
    return _URL_IN_TEXT.sub(lambda m: redact_url(m.group(0)) or "", text)


class _RedactingStream(io.TextIOBase):
    """A text stream that writes `redact(s)` to the stream it wraps."""

    def __init__(self, inner):
        self._inner = inner

    def write(self, s: str) -> int:
        if not isinstance(s, str):
            # as a text stream does: click (Flask's banner) probes with `write(b"")` for a binary stream
            # and, when that is accepted, writes bytes, which came out as `b''b" * Serving Flask app..."`
            raise TypeError(f"write() argument must be str, not {type(s).__name__}")
        self._inner.write(redact(s))
        return len(s)

    def flush(self) -> None:
        self._inner.flush()

    def isatty(self) -> bool:
        return self._inner.isatty()

    def fileno(self) -> int:
        return self._inner.fileno()

    @property
    def encoding(self):  # type: ignore[override]
        return getattr(self._inner, "encoding", "utf-8")


@contextlib.contextmanager
def redacted_output() -> Iterator[None]:
    """sys.stdout and sys.stderr redacted for the duration (a command line's whole run)."""
    out, err = sys.stdout, sys.stderr
    sys.stdout, sys.stderr = _RedactingStream(out), _RedactingStream(err)
    try:
        yield
    finally:
        sys.stdout, sys.stderr = out, err


_installed = False


def install_log_redaction() -> None:
    """Redact every log record of this process when it is made (message, arguments, traceback),
    whichever logger and handler it goes to. Idempotent."""
    global _installed
    if _installed:
        return
    previous = logging.getLogRecordFactory()

    def factory(*args, **kwargs):
        record = previous(*args, **kwargs)
        try:
            message = record.getMessage()
        except Exception:  # noqa: BLE001 - a bad format string: logging reports it as it would
            return record
        if "://" in message:
            record.msg, record.args = redact(message), None
        if record.exc_info and not record.exc_text:
            record.exc_text = redact(logging.Formatter().formatException(record.exc_info))
        if record.stack_info:
            record.stack_info = redact(record.stack_info)
        return record

    logging.setLogRecordFactory(factory)
    _installed = True
