"""Users of an image: a USER (name, uid, name:group, uid:gid) resolved from the image's own
/etc/passwd and /etc/group, and those files read from the image's layers on the host.

The files are the image's, so hostile input: a read takes at most MAX_USERDB_BYTES (a larger
file is refused by its size, before any byte is read), nothing is followed through a symbolic
link or across a mount, a FIFO or device is refused without being opened for reading, and a
line that is not an account is skipped, never a 500. Ids are those of a sandbox's user
namespace (0-65535)."""

from __future__ import annotations

import os
import stat
from collections.abc import Callable, Sequence
from pathlib import Path, PurePosixPath
from typing import NamedTuple

from dsec import errors
from dsec.isolation import linux
from dsec.layers.builders.common import _OPAQUE_XATTR

MAX_USERDB_BYTES = 1 << 20
ID_LIMIT = 65536
_WALK = (
    linux.RESOLVE_BENEATH | linux.RESOLVE_NO_SYMLINKS | linux.RESOLVE_NO_MAGICLINKS | linux.RESOLVE_NO_XDEV
)

Reader = Callable[[str], "bytes | None"]
"""An image file's bytes by absolute path (None: the image has no such file)."""


class Account(NamedTuple):
    uid: int
    gid: int
    home: str


def resolve_user(user: str, read: Reader) -> Account:
    """`root`, a name of /etc/passwd, `uid`, or either with `:group` (a name of /etc/group or
    a gid). A uid alone keeps gid = uid and home /; a name takes its primary group and home.
    Anything the image does not have is an :class:`errors.InvalidRequest` naming it."""
    if user == "root":
        return Account(0, 0, "/root")
    name, sep, group = user.partition(":")
    if not name or ":" in group or (sep and not group):
        raise errors.InvalidRequest(f"user {user[:80]!r} is invalid: give root, a name, uid or uid:gid")
    if name.isdigit():
        uid, gid, home = _id(name, user), None, "/"
    else:
        entry = _lookup(read, "/etc/passwd", name, user)
        uid, gid, home = _id(entry[2], user), _id(entry[3], user), entry[5] or "/"
    if group:
        gid = _id(group, user) if group.isdigit() else _id(_lookup(read, "/etc/group", group, user)[2], user)
    return Account(uid, uid if gid is None else gid, home)


def _id(text: str, user: str) -> int:
    if not text.isdigit() or int(text) >= ID_LIMIT:
        raise errors.InvalidRequest(
            f"user {user[:80]!r}: id {text[:20]!r} is not a number below {ID_LIMIT} (a sandbox's ids)"
        )
    return int(text)


def _lookup(read: Reader, path: str, name: str, user: str) -> list[str]:
    """The line of `path` (passwd: 7 fields, group: 4) whose first field is `name`."""
    want = 7 if path == "/etc/passwd" else 4
    data = read(path)
    for line in (data or b"").decode(errors="replace").splitlines():
        fields = line.split(":")
        if len(fields) >= want and fields[0] == name:
            return fields
    what = "user" if want == 7 else "group"
    raise errors.InvalidRequest(
        f"user {user[:80]!r}: {what} {name[:80]!r} is not in the image's {path}"
        f"{'' if data is not None else ' (the image has none)'}; give a uid or uid:gid, or an "
        f"existing {what}",
        reason="unknown_user",
    )


# --------------------------------------------------------------------------- the image's files


def read_image_file(lowers: Sequence[Path], path: str, limit: int = MAX_USERDB_BYTES) -> bytes | None:
    """`path` as the overlay of `lowers` (layer trees, TOP first) shows it: the topmost layer
    that has it, unless a whiteout or an opaque directory above hides it (None: absent)."""
    parts = PurePosixPath(path).parts[1:]
    if not parts or ".." in parts:
        raise errors.InvalidRequest(f"{path!r} is not a plain absolute path")
    for lower in lowers:
        found, data = _in_layer(lower, parts, path, limit)
        if found:
            return data
    return None


def _in_layer(root: Path, parts: tuple[str, ...], path: str, limit: int) -> tuple[bool, bytes | None]:
    """(True, bytes) found; (True, None) hidden here (a whiteout, an opaque directory, a file in
    the way); (False, None) this layer says nothing: look below."""
    fd = os.open(root, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    opaque = False
    try:
        for i, name in enumerate(parts):
            try:
                st = os.stat(name, dir_fd=fd, follow_symlinks=False)
            except (FileNotFoundError, NotADirectoryError):
                return opaque, None
            if stat.S_ISCHR(st.st_mode) and st.st_rdev == 0:  # an overlay whiteout
                return True, None
            if stat.S_ISLNK(st.st_mode):
                raise errors.InvalidRequest(
                    f"the image's {path} goes through a symbolic link ({'/'.join(parts[: i + 1])}); "
                    "users are only read from plain files: give a uid or uid:gid",
                    reason="unsafe_user_database",
                )
            if i == len(parts) - 1:
                return True, _read_regular(fd, name, st, path, limit)
            if not stat.S_ISDIR(st.st_mode):
                return True, None  # a file where a directory would be hides all below
            nfd = linux.openat2(fd, name, os.O_PATH | os.O_DIRECTORY, 0, _WALK)
            os.close(fd)
            fd = nfd
            opaque = opaque or _opaque(fd)
    finally:
        os.close(fd)
    return False, None


def _opaque(dirfd: int) -> bool:
    try:
        return os.getxattr(f"/proc/self/fd/{dirfd}", _OPAQUE_XATTR) == b"y"
    except OSError:
        return False


def _read_regular(dirfd: int, name: str, st: os.stat_result, path: str, limit: int) -> bytes:
    if not stat.S_ISREG(st.st_mode):
        raise errors.InvalidRequest(
            f"the image's {path} is not a regular file; give a uid or uid:gid", reason="unsafe_user_database"
        )
    if st.st_size > limit:
        raise _too_large(path, limit)
    fd = linux.openat2(dirfd, name, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW, 0, _WALK)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise errors.InvalidRequest(f"the image's {path} is not a regular file")
        chunks, left = [], limit + 1
        while left > 0 and (chunk := os.read(fd, min(left, 1 << 16))):
            chunks.append(chunk)
            left -= len(chunk)
    finally:
        os.close(fd)
    if left <= 0:
        raise _too_large(path, limit)
    return b"".join(chunks)


def _too_large(path: str, limit: int) -> errors.InvalidRequest:
    return errors.InvalidRequest(
        f"the image's {path} is larger than {limit} bytes, more than users are read from; "
        "give a uid or uid:gid",
        reason="unsafe_user_database",
    )
