"""What a tar that leaves a sandbox may hold: the rules the edge applies when it builds or
rebuilds a download (dsec.edge.tarcheck) and the SDK applies again when it extracts one
(dsec.client._extract). Pure: it imports only the error tree, so both sides share it.

A sandbox's tools, its guest kernel and its files are the agent's, so every name and link
in an archive of them is hostile until checked. An archive that passes holds only:

* directories, regular files, symbolic links and hard links to an earlier regular file;
* relative names without `..` or NUL, each at most PATH_MAX (a part at most NAME_MAX), each
  only once;
* nothing below a link or a file (a member never goes through a link: "link, then a file
  through it" is refused whichever comes first);
* links that resolve inside the archive root, followed as the kernel would follow them
  (a `..` after a link climbs from where the link led, not from its name), at most
  MAX_LINK_CHAIN links deep and with a bounded amount of work for the whole archive;
* no link resolves through a name that only a case-insensitive or normalising file system
  (macOS, Windows: where a trainer may extract) would take for another link of the archive
  ("Q" -> "." and "x" -> "q/.." stay inside on Linux, and climb out of the destination there).
"""

from __future__ import annotations

import tarfile
import unicodedata
from collections.abc import Callable
from typing import Literal

from dsec import errors

Kind = Literal["dir", "file", "link"]
PATH_MAX = 4095  # bytes of a name, a link's target, or a path a link resolves to
NAME_MAX = 255  # bytes of one part of a name (every Linux file system's bound)
MAX_LINK_CHAIN = 40  # links followed from one link (the kernel's own MAXSYMLINKS)
MAX_RESOLVE_STEPS = 4_000_000  # components walked to check every link of one archive
_MEMO_CHARS = 32 << 20  # resolved paths remembered per archive (beyond: walked again)
_IMPLIED = "directory"  # a parent no member declared (yet): made as a directory


def member_name(name: str, what: str) -> str:
    """A member's name, normalised ("a/b"; "" for the archive root). Refuses absolute names,
    `..`, NUL bytes, names longer than PATH_MAX and parts longer than NAME_MAX (which no
    file system holds: an extractor would stop there, midway)."""
    if not name or "\0" in name:
        raise errors.InvalidRequest(f"{what}: a member name {name[:80]!r} is empty or holds a NUL byte")
    size = len(name.encode("utf-8", "surrogateescape"))
    if size > PATH_MAX:
        raise errors.InvalidRequest(
            f"{what}: member {name[:80]!r}... has a name longer than {PATH_MAX} bytes"
        )
    if name.startswith("/"):
        raise errors.PathEscape(f"{what}: member {name[:200]!r} has an absolute name")
    parts = [p for p in name.split("/") if p not in ("", ".")]
    if ".." in parts:
        raise errors.PathEscape(f"{what}: member {name[:200]!r} climbs out of the archive with '..'")
    for p in parts if size > NAME_MAX else ():
        if len(p.encode("utf-8", "surrogateescape")) > NAME_MAX:
            raise errors.InvalidRequest(
                f"{what}: member {name[:80]!r}... has a part longer than {NAME_MAX} bytes, which no "
                "file system holds"
            )
    return "/".join(parts)


def folded(name: str) -> str:
    """`name` as a case-insensitive, normalising file system compares it (macOS's APFS and
    HFS+, Windows' NTFS): case folded, Unicode decomposed, format characters dropped."""
    if name.isascii():
        return name.lower()
    decomposed = unicodedata.normalize("NFKD", unicodedata.normalize("NFKD", name).casefold())
    return "".join(c for c in decomposed if unicodedata.category(c) != "Cf")


class ArchiveTree:
    """The names of one archive as they stream by (`add`), then every link checked once all
    are known (`check_links`). `foreign(path)`: whether `path`, which no member names, is a
    symbolic link already there (the SDK's destination); the edge has none.
    `any_link_target`: a symbolic link may point anywhere, as data: for an archive that only
    a sandbox's own tar unpacks, into an emptied directory of its own (a trusted exec's copy
    of the task files, dsec.edge.gradersandbox), where no member goes through a link either
    way and links are written last; nothing on the host resolves them."""

    def __init__(
        self, what: str, foreign: Callable[[str], bool] | None = None, *, any_link_target: bool = False
    ) -> None:
        self.what = what
        self.any_link_target = any_link_target
        self.kinds: dict[str, str] = {"": "dir"}
        self.links: dict[str, str] = {}
        self._folded_links: set[str] = set()
        self._foreign = foreign
        self._resolved: dict[str, str] = {}
        self._memo_chars = 0
        self._steps = 0

    def add(self, name: str, kind: Kind, target: str | None = None) -> None:
        """Member `name` (from `member_name`) of `kind`; a link's `target` (a hard link's: a
        name from `member_name`, an earlier regular file)."""
        w = self.what
        if name == "":
            if kind != "dir":
                raise errors.InvalidRequest(f"{w}: the archive root is a {kind}, not a directory")
            return
        prev = self.kinds.get(name)
        if prev == _IMPLIED and kind != "dir":
            raise errors.PathEscape(f"{w}: {name[:200]!r} holds other members, so it cannot be a {kind}")
        if prev is not None and prev != _IMPLIED:
            raise errors.InvalidRequest(f"{w}: {name[:200]!r} is in the archive twice")
        parent = name.rpartition("/")[0]
        while (pk := self.kinds.get(parent)) is None:
            self.kinds[parent] = _IMPLIED
            parent = parent.rpartition("/")[0]
        if pk not in ("dir", _IMPLIED):
            raise errors.PathEscape(
                f"{w}: member {name[:200]!r} lies below {parent[:200]!r}, which is a {pk}: "
                "nothing in an archive goes through a link or a file"
            )
        if kind == "link":
            if not target or "\0" in target or len(target.encode("utf-8", "surrogateescape")) > PATH_MAX:
                raise errors.InvalidRequest(f"{w}: link {name[:200]!r} has an empty, NUL or over-long target")
            if self.any_link_target:
                self.kinds[name] = kind
                return
            if target.startswith("/"):
                raise errors.PathEscape(
                    f"{w}: link {name[:200]!r} points at {target[:200]!r}, an absolute path: links in an "
                    "archive must stay inside it; archive the directory it points into, or replace the "
                    "link with a relative one (or a copy) first"
                )
            fold = folded(name)
            if fold in self._folded_links:
                raise errors.InvalidRequest(
                    f"{w}: link {name[:200]!r} and another link of the archive differ only by case or "
                    "Unicode form: one would replace the other on macOS or Windows; rename one of them"
                )
            self.links[name] = target
            self._folded_links.add(fold)
        elif target is not None and self.kinds.get(target) != "file":  # a hard link: to a file before it
            raise errors.PathEscape(
                f"{w}: hard link {name[:200]!r} names {target[:200]!r}, which is no regular file "
                "before it in the archive"
            )
        self.kinds[name] = kind

    def add_member(self, m: tarfile.TarInfo) -> str:
        """A tar member (a directory, a regular file, a symbolic link or a hard link; no
        sparse file, device or FIFO), added by its name; that name, normalised."""
        w = self.what
        name = member_name(m.name, w)
        if m.isdir():
            self.add(name, "dir")
        elif m.issparse():
            raise errors.InvalidRequest(f"{w}: {m.name[:200]!r} is a sparse file; send it as a regular one")
        elif m.isreg():
            self.add(name, "file")
        elif m.issym():
            self.add(name, "link", m.linkname)
        elif m.islnk():
            self.add(name, "file", member_name(m.linkname, w))
        else:
            raise errors.InvalidRequest(
                f"{w}: {m.name[:200]!r} is a device, FIFO or other special file; an archive here holds "
                "only files, directories and links"
            )
        return name

    def check_links(self) -> None:
        """Every symbolic link resolves inside the archive root (see the module)."""
        for name in self.links:
            self._resolve(name, [])

    def _step(self, n: int = 1) -> None:
        self._steps += n
        if self._steps > MAX_RESOLVE_STEPS:
            raise errors.PayloadTooLarge(
                f"{self.what}: its links take more than {MAX_RESOLVE_STEPS} steps to resolve; "
                "archive a narrower path"
            )

    def _resolve(self, link: str, chain: list[str]) -> str:
        """Where `link` leads (a path inside the root, "" for the root itself)."""
        done = self._resolved.get(link)
        if done is not None:
            return done
        w, target = self.what, self.links[link]
        if link in chain or len(chain) >= MAX_LINK_CHAIN:
            raise errors.InvalidRequest(
                f"{w}: link {link[:200]!r} is part of a loop or of a chain of more than "
                f"{MAX_LINK_CHAIN} links; replace it before archiving"
            )
        chain.append(link)
        parent = link.rpartition("/")[0]
        cur = self._prefixes(parent)  # the path walked so far, as the prefixes of its parts
        for part in target.split("/"):
            self._step()
            if part in ("", "."):
                continue
            if part == "..":
                if not cur:
                    raise errors.PathEscape(
                        f"{w}: link {link[:200]!r} -> {target[:200]!r} leads out of the archive: links "
                        "in an archive must stay inside it; archive the directory it points into, or "
                        "replace the link first"
                    )
                cur.pop()
                continue
            key = f"{cur[-1]}/{part}" if cur else part
            if len(key) > PATH_MAX:
                raise errors.InvalidRequest(
                    f"{w}: link {link[:200]!r} resolves to a path over {PATH_MAX} bytes"
                )
            if key in self.links:
                cur = self._prefixes(self._resolve(key, chain))
            else:
                if self._folded_links and folded(key) in self._folded_links:
                    raise errors.PathEscape(
                        f"{w}: link {link[:200]!r} -> {target[:200]!r} passes through {key[:200]!r}, "
                        "which a case-insensitive file system (macOS, Windows) takes for another link "
                        "of the archive; rename one of them"
                    )
                if self._foreign is not None and key not in self.kinds and self._foreign(key):
                    raise errors.PathEscape(
                        f"{w}: link {link[:200]!r} -> {target[:200]!r} passes through {key[:200]!r}, a "
                        "symbolic link that is not part of the archive"
                    )
                cur.append(key)
        chain.pop()
        out = cur[-1] if cur else ""
        if self._memo_chars + len(out) <= _MEMO_CHARS:
            self._resolved[link] = out
            self._memo_chars += len(out)
        return out

    def _prefixes(self, path: str) -> list[str]:
        if not path:
            return []
        parts = path.split("/")
        self._step(len(parts))
        out, acc = [], ""
        for p in parts:
            acc = f"{acc}/{p}" if acc else p
            out.append(acc)
        return out
