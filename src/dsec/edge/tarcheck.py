"""Every archive a download returns is written through `CleanTar`: the host's own archiver
of a container's or gVisor sandbox's files (dsec.edge.files) writes into one, and a tar a
sandbox made itself (a microVM's, by the guest's `tar`: the agent is root in its own kernel
and may have replaced it) is parsed and rebuilt into one by `rebuild`, member by member.

What comes out is the shape dsec.archive describes, with headers of our own: directories,
regular files, symbolic links and hard links to an earlier file; relative names without
`..`; nothing through a link or a file; every link resolving inside the archive (links are
written last, once all names are known, so even a naive extractor makes them after the
files); permission bits, clamped times and numeric owners only (no pax records, user names,
xattrs or sparse maps of the source). Devices, FIFOs and sockets are left out: nothing a
download needs. File data is bounded while it streams (a size header larger than what is
left of the budget is refused before a byte of it is read; a sparse member counts whole).
A violation is an error and the caller's spool is discarded: nothing partial is forwarded.
"""

from __future__ import annotations

import contextlib
import tarfile
from typing import IO, Any, Protocol

from dsec import errors
from dsec.archive import ArchiveTree, member_name


class Reader(Protocol):
    def read(self, n: int = -1, /) -> bytes: ...


_MAX_TIME = 8**11 - 1  # what a plain tar header holds (year 2242)
_MAX_ID = 2**32 - 2


class CleanTar:
    """A tar stream written to `out` that only ever holds a clean archive (see the module).
    `addfile` takes what `tarfile.TarFile.addfile` takes; close it (or leave its `with`
    normally) to check the links and write them; leaving it by an exception writes nothing
    more. `what`: the archive, as error messages name it."""

    def __init__(
        self, out: IO[bytes], what: str, max_bytes: int, max_entries: int, *, any_link_target: bool = False
    ) -> None:
        self._tf = tarfile.open(fileobj=out, mode="w|", format=tarfile.GNU_FORMAT)  # noqa: SIM115
        self.what = what
        self.tree = ArchiveTree(what, any_link_target=any_link_target)  # (see dsec.archive)
        self._links: list[tarfile.TarInfo] = []
        self._files: dict[str, str] = {}  # regular files so far: name -> the name written
        self._left = max_bytes
        self._max_bytes = max_bytes
        self._entries_left = max_entries

    def __enter__(self) -> CleanTar:
        return self

    def __exit__(self, exc_type: Any, *_: Any) -> None:
        if exc_type is None:
            self.close()
        else:  # the caller discards what was written
            with contextlib.suppress(Exception):
                self._tf.close()

    def addfile(self, info: tarfile.TarInfo, fileobj: Reader | None = None) -> None:
        name = member_name(info.name, self.what)
        hard = None
        if info.isdir():
            self.tree.add(name, "dir")
        elif info.isreg():
            if info.size > self._left:
                raise errors.PayloadTooLarge(
                    f"{self.what} holds more than {self._max_bytes} bytes of file data ({info.name[:200]!r} "
                    f"alone claims {info.size}); archive a narrower path"
                )
            self.tree.add(name, "file")
        elif info.issym():
            self.tree.add(name, "link", info.linkname)
        elif info.islnk():
            hard = member_name(info.linkname, self.what)
            self.tree.add(name, "file", hard)
        else:
            return  # a device, FIFO or other special file: not data, left out
        self._entries_left -= 1
        if self._entries_left < 0:
            raise errors.PayloadTooLarge(f"{self.what} holds too many entries; archive a subdirectory")
        clean = _header(info, name)
        if info.issym():
            clean.type, clean.linkname = tarfile.SYMTYPE, info.linkname
            self._links.append(clean)
            return
        if hard is not None:
            clean.type, clean.linkname = tarfile.LNKTYPE, self._files[hard]
            self._files[name] = clean.name
        elif info.isreg():
            clean.type, clean.size = tarfile.REGTYPE, info.size
            self._left -= info.size
            self._files[name] = clean.name
        else:
            clean.type = tarfile.DIRTYPE
        try:
            self._tf.addfile(clean, fileobj if clean.size else None)
        except (OSError, tarfile.TarError, EOFError) as e:
            raise errors.InvalidRequest(f"{self.what}: member {info.name[:200]!r} is cut short ({e})") from e

    def close(self) -> None:
        try:
            self.tree.check_links()
            for link in self._links:
                self._tf.addfile(link)
        finally:  # (after a refusal too: the stream is done with; what it wrote is discarded)
            self._tf.close()


def _header(info: tarfile.TarInfo, name: str) -> tarfile.TarInfo:
    """A header of our own for a member: its name as written ("./a" stays "./a"), its
    permission bits, a time and owners a tar header holds; nothing else of the source."""
    shown = name or "."
    if name and info.name.startswith("./"):
        shown = f"./{name}"
    clean = tarfile.TarInfo(shown)
    clean.mode = info.mode & 0o7777
    try:
        clean.mtime = min(max(int(info.mtime), 0), _MAX_TIME)
    except (OverflowError, ValueError, TypeError):  # inf, nan or garbage from a pax record
        clean.mtime = 0
    clean.uid = info.uid if isinstance(info.uid, int) and 0 <= info.uid <= _MAX_ID else 65534
    clean.gid = info.gid if isinstance(info.gid, int) and 0 <= info.gid <= _MAX_ID else 65534
    clean.uname = clean.gname = ""
    return clean


def rebuild(
    src: IO[bytes],
    out: IO[bytes],
    what: str,
    max_bytes: int,
    max_entries: int,
    *,
    any_link_target: bool = False,
) -> None:
    """Parse the tar a sandbox made from `src` and write its clean rebuild to `out` (see
    the module); a malformed or hostile one is a 4xx naming what is wrong."""
    try:
        with (
            tarfile.open(fileobj=src, mode="r|") as tf,
            CleanTar(out, what, max_bytes, max_entries, any_link_target=any_link_target) as clean,
        ):
            for member in tf:
                data = tf.extractfile(member) if member.isreg() else None
                clean.addfile(member, data)
    except (tarfile.TarError, EOFError, UnicodeError) as e:
        raise errors.InvalidRequest(
            f"{what}: the sandbox's tar wrote something that is not a tar archive ({e}); the file API "
            "needs GNU tar in the image"
        ) from e
