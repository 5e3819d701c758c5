"""Credentials out of every text phalanx shows or keeps (errors, events, the run DB, reports).

``redact(text)`` replaces with ``***``:

- the password of any URL's userinfo (``redis://:pw@h``, ``rediss://user:pw@h``,
  ``postgres://u:pw@h/db``, ``https://u:pw@h``...); a userinfo without a password (a bare token,
  ``https://token@host``) is masked whole;
- the value of any secret-named parameter or setting: ``?password=…``, ``&secret_key=…``,
  ``AWS_SECRET_ACCESS_KEY=…``, ``PHALANX_AUTHKEY=…``, ``{'token': '…'}``, ``"api_key": "…"``;
- wherever they appear, the values of this process's secret-named environment variables and
  the passwords of URLs held in its environment (a password seen apart from its URL).

It errs on the side of masking: a few harmless words after ``token=`` are lost, never a secret.
"""

from __future__ import annotations

import functools
import os
import re
from collections.abc import Iterator

MASK = "***"

_KEYWORD = r"(?:password|passwd|secret|token|api[_-]?key|access[_-]?key|auth[_-]?key|credential)s?"
_SECRET_NAME = re.compile(rf"\w*?{_KEYWORD}\w*", re.IGNORECASE)  # an environment variable's name
# name=value, 'name': 'value', "name": "value" — not name: value, which is how messages name a
# field ("stages.x.password: unknown key"); the name's prefix is left as it is
_ASSIGNMENT = re.compile(
    rf"({_KEYWORD}\w{{0,64}}(?:['\"]?\s{{0,8}}=|['\"]\s{{0,8}}:)\s{{0,8}}['\"]?)"
    rf"([^\s'\"&,;)}}\]]+)",
    re.IGNORECASE,
)
_SCHEME = re.compile(r"\b[A-Za-z][A-Za-z0-9+.-]{0,30}://")
_AUTHORITY_END = re.compile(r"[\s?#'\"<>]")  # an unencoded password may hold '/' or '@'
_WINDOW = 1300  # userinfo longer than this is not looked for: the search stays linear
_MIN_LEN = 8  # a shorter environment value is masked only where a pattern finds it


def _userinfos(text: str) -> Iterator[tuple[int, int, str, str | None]]:
    """(start, end, user, password or None) of every URL userinfo in ``text``."""
    if "@" not in text or "://" not in text:
        return
    done = 0
    for m in _SCHEME.finditer(text):
        start = m.end()
        if start < done:  # inside the userinfo found last
            continue
        stop = _AUTHORITY_END.search(text, start, start + _WINDOW)
        at = text.rfind("@", start, stop.start() if stop else start + _WINDOW)
        user, colon, password = text[start : max(at, start)].partition(":")
        if at >= 0 and "/" not in user:  # else a path with '@' in it, not a userinfo
            done = at
            yield start, at, user, password if colon else None


def _mask_userinfo(text: str) -> str:
    out, pos = [], 0
    for start, end, user, password in _userinfos(text):
        out += [text[pos:start], MASK if password is None else f"{user}:{MASK}"]
        pos = end
    return "".join(out) + text[pos:] if out else text


@functools.lru_cache(maxsize=4)
def _secrets_in(environ: tuple[tuple[str, str], ...]) -> tuple[str, ...]:
    found = {value for name, value in environ if _SECRET_NAME.fullmatch(name)}
    found |= {
        user if password is None else password for _, value in environ for _, _, user, password in _userinfos(value)
    }
    # longest first: a secret that contains another is masked whole
    return tuple(sorted((s for s in found if len(s) >= _MIN_LEN and s != MASK), key=len, reverse=True))


def redact(text: str) -> str:
    """``text`` with every credential it holds replaced by ``***``."""
    if not text:
        return text
    for secret in _secrets_in(tuple(os.environ.items())):
        text = text.replace(secret, MASK)
    return _ASSIGNMENT.sub(lambda m: m.group(1) + MASK, _mask_userinfo(text))


def redact_opt(text: str | None) -> str | None:
    """``redact`` for a value that may be None (a database column)."""
    return redact(text) if isinstance(text, str) else text
