"""What every builder shares: progress messages, archive magic numbers, the xattrs a layer keeps."""

from __future__ import annotations

from collections.abc import Callable

Progress = Callable[[str], None]

_CHUNK = 1 << 20
_ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"
_GZIP_MAGIC = b"\x1f\x8b"
_OPAQUE_XATTR = "trusted.overlay.opaque"
_SKIP_XATTRS = frozenset({"security.selinux"})
_TAR_FORMATS = "a .tar, .tar.gz (or .tgz, .tar.xz, .tar.bz2) or, when the zstd tool is installed, .tar.zst"
_OCI_FORMATS = (
    "a `docker save` tar (manifest.json with Config and Layers), an OCI image layout directory "
    "(oci-layout, index.json, blobs/sha256/...) or a tar of an OCI image layout"
)


def _say(progress: Progress | None, msg: str) -> None:
    if progress is not None:
        progress(msg)
