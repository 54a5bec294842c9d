"""Making layers: Debian roots with mmdebstrap, and imports of directories, tarballs and
OCI / docker archives.

Every builder fills a staging directory with *container-side* ownership and commits it with
``shift=True``, so the store applies the uid/gid offset exactly once. The parts: debian.py
(recipes), tree.py (directories), tar.py (tarballs), oci.py (OCI / docker archives),
common.py; `dsec.layers` exports what callers use.
"""
