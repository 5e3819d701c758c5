"""Directories and files only this user can use.

phalanx keeps data under shared locations by default (``/dev/shm/phalanx-<user>``,
``/tmp/phalanx-<user>``, ``/var/tmp/phalanx-<user>``) and its run database under a state
directory.  Another local user who creates such a directory first — mode 777, or their own —
could read every dataset and replace the catalogue.  Like ssh (``~/.ssh``) and Ray (its temp
directory), phalanx refuses a directory it did not make private: ``private_dir`` creates it
0700, or checks that an existing one is a real directory owned by this user and writable by
no one else.  Files phalanx creates in them are 0600 (``create_private``, ``opener``).

A directory the user names (``PHALANX_STORE``, a site's ``store.root``) is not checked: a
group-shared project directory on a cluster file system is the user's choice.
"""

from __future__ import annotations

import os
import pwd
import stat
from pathlib import Path

from .errors import UnsafePathError

DIR_MODE = 0o700
FILE_MODE = 0o600


def _user(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return "an unknown user"


def _problems(path: Path, st: os.stat_result) -> list[str]:
    if stat.S_ISLNK(st.st_mode):
        return [f"it is a symbolic link (to {os.readlink(path)})"]
    problems = [] if stat.S_ISDIR(st.st_mode) else ["it is not a directory"]
    if st.st_uid != os.getuid():
        problems.append(
            f"it is owned by {_user(st.st_uid)} (uid {st.st_uid}), not by you ({_user(os.getuid())}, uid {os.getuid()})"
        )
    if st.st_mode & 0o022:
        problems.append(
            f"its mode {stat.S_IMODE(st.st_mode):04o} lets "
            f"{'group and others' if st.st_mode & 0o002 else 'its group'} write in it"
        )
    return problems


def private_dir(path: str | os.PathLike, what: str, instead: str) -> Path:
    """``path`` as a directory only this user can use: created 0700 when missing (its parents
    as they come), else checked — owned by this user, not a symbolic link, not writable by
    group or others — and made 0700 if others could read it.

    Raises ``UnsafePathError`` naming the path, its owner and mode, and what to do; ``what``
    says what the directory is for, ``instead`` how to use another one."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        path.mkdir(mode=DIR_MODE)
    except FileExistsError:
        pass
    st = os.lstat(path)
    problems = _problems(path, st)
    if problems:
        mine = st.st_uid == os.getuid() and not stat.S_ISLNK(st.st_mode)
        fix = (
            f"if nothing in it was put there by someone else, `chmod 700 {path}`"
            if mine
            else f"remove it (as its owner or root: `rm -rf {path}`) after checking what is in it"
        )
        raise UnsafePathError(
            f"refusing to use {path} ({what}): {'; '.join(problems)}. Another local user could "
            f"read or replace your data there. {fix[0].upper() + fix[1:]}, or {instead}."
        )
    if st.st_mode & 0o077:
        os.chmod(path, DIR_MODE)
    return path


def makedirs(path: str | os.PathLike) -> Path:
    """``mkdir -p`` whose new directories are 0700 (existing ones are left as they are)."""
    target = missing = Path(path)
    todo = []
    while not missing.exists() and missing != missing.parent:
        todo.append(missing)
        missing = missing.parent
    for p in reversed(todo):
        try:
            p.mkdir(mode=DIR_MODE)
        except FileExistsError:
            pass
    return target


def opener(path: str | os.PathLike, flags: int) -> int:
    """For ``open(..., opener=opener)``: a file it creates is readable by this user only."""
    return os.open(path, flags, FILE_MODE)


def create_private(path: str | os.PathLike, truncate: bool = False) -> Path:
    """Create ``path`` (empty) readable by this user only, unless it exists; with ``truncate``
    an existing file is emptied.  SQLite gives a database's -wal and -shm files its mode."""
    os.close(os.open(path, os.O_WRONLY | os.O_CREAT | (os.O_TRUNC if truncate else 0), FILE_MODE))
    return Path(path)


def read_private_file(path: str | os.PathLike, what: str) -> str:
    """The text of ``path``, a regular file of this user's that only this user can read (a
    secret: a token, credentials); ``UnsafePathError`` naming ``what`` and the path otherwise —
    never the contents."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise UnsafePathError(f"{what} {path} is not a regular file")
        if st.st_uid != os.getuid():
            raise UnsafePathError(
                f"{what} {path} is owned by {_user(st.st_uid)} (uid {st.st_uid}), not by you ({_user(os.getuid())})"
            )
        if st.st_mode & 0o077:
            raise UnsafePathError(
                f"{what} {path} has mode {stat.S_IMODE(st.st_mode):04o}: others could read it (chmod 600 it)"
            )
        return os.read(fd, 1 << 20).decode()
    finally:
        os.close(fd)
