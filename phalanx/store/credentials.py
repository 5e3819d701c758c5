"""S3 credentials by reference: what a site file or a store URL names instead of the secret.

A store, write-through target or exchange on an object store may carry
``credentials=REFERENCE`` among its URL options; the reference travels (in site files, in
``PHALANX_STORE`` to ranks, in run records), the secret never does — each process resolves it
where it runs:

- ``env:NAME`` — the variables ``NAME_ACCESS_KEY_ID``, ``NAME_SECRET_ACCESS_KEY`` and, if set,
  ``NAME_SESSION_TOKEN`` (so two sites' object stores can hold different keys in one driver's
  environment; ranks inherit it);
- ``file:PATH`` — an AWS-style credentials file (``aws_access_key_id``,
  ``aws_secret_access_key``, optional ``aws_session_token``; section ``[default]``, or
  ``file:PATH#PROFILE``), a regular file of this user's that only this user can read.

Without a reference the AWS variables and credential chain apply, as before.  Errors name the
reference, the variable or the file — never a value.
"""

from __future__ import annotations

import configparser
import os

from ..private import read_private_file

_FIELDS = {"access_key": "ACCESS_KEY_ID", "secret_key": "SECRET_ACCESS_KEY", "session_token": "SESSION_TOKEN"}


def resolve(reference: str) -> dict[str, str]:
    """``S3FileSystem`` keyword arguments (access_key, secret_key[, session_token]) named by
    ``reference``; ``ValueError`` (``UnsafePathError`` for an unsafe file) saying what is wrong."""
    kind, _, rest = reference.partition(":")
    if kind == "env" and rest:
        return _from_env(rest)
    if kind == "file" and rest:
        path, _, profile = rest.partition("#")
        return _from_file(os.path.expanduser(path), profile or "default")
    raise ValueError(f"credentials {reference!r}: expected env:NAME or file:PATH[#PROFILE]")


def _from_env(name: str) -> dict[str, str]:
    out = {key: os.environ[f"{name}_{suffix}"] for key, suffix in _FIELDS.items() if os.environ.get(f"{name}_{suffix}")}
    missing = [f"{name}_{_FIELDS[k]}" for k in ("access_key", "secret_key") if k not in out]
    if missing:
        raise ValueError(f"credentials env:{name}: {' and '.join(missing)} not set in this process's environment")
    return out


def _from_file(path: str, profile: str) -> dict[str, str]:
    parser = configparser.ConfigParser(interpolation=None)
    try:
        parser.read_string(read_private_file(path, "credentials file"), source=path)
    except configparser.Error as exc:
        raise ValueError(f"credentials file {path}: not an AWS-style credentials file ({type(exc).__name__})") from None
    if not parser.has_section(profile):
        raise ValueError(f"credentials file {path}: no [{profile}] section")
    section = parser[profile]
    out = {
        key: section[f"aws_{suffix.lower()}"] for key, suffix in _FIELDS.items() if section.get(f"aws_{suffix.lower()}")
    }
    missing = [f"aws_{_FIELDS[k].lower()}" for k in ("access_key", "secret_key") if k not in out]
    if missing:
        raise ValueError(f"credentials file {path} [{profile}]: no {' or '.join(missing)}")
    return out
