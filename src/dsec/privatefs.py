"""The platform's data at rest is root's alone: directories 0700, files 0600.

Each sandbox runs as a host id range of its own (isolation/idranges.py) and the layer store
is owned by the canonical range ``uid_offset`` (100000); nothing a sandbox's id could reach
on the host may be readable or writable by it: the IAM database,
the trajectory logs, the edge's records (and their SQLite -wal/-shm sidecars, which SQLite
creates with the database file's mode), lock files, tokens, checkpoints. The process umask
is not changed (the edge creates files *inside* sandboxes with the modes callers ask for);
every data file is created with an explicit mode instead, and an existing install is
fixed when it starts (``seal_data_dir``).
"""

from __future__ import annotations

import contextlib
import os
import stat
from pathlib import Path

DIR_MODE = 0o700
FILE_MODE = 0o600
SQLITE_SIDECARS = ("-wal", "-shm", "-journal")


def private_dir(path: Path) -> Path:
    """Create `path` (and parents, with the default mode) if missing; make it 0700."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with contextlib.suppress(FileExistsError):
        path.mkdir(mode=DIR_MODE)
    os.chmod(path, DIR_MODE)
    return path


def private_file(path: Path) -> Path:
    """Create `path` empty if missing; make it and its SQLite sidecars 0600 (call before
    sqlite3.connect: SQLite gives the -wal and -shm files the database's mode)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, FILE_MODE)
    try:
        os.fchmod(fd, FILE_MODE)
    finally:
        os.close(fd)
    for suffix in SQLITE_SIDECARS:
        with contextlib.suppress(FileNotFoundError):
            os.chmod(f"{path}{suffix}", FILE_MODE, follow_symlinks=False)
    return path


def open_private(path: Path, flags: int) -> int:
    """os.open(path, flags | O_CREAT) with mode 0600, also for a file that already existed."""
    fd = os.open(path, flags | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, FILE_MODE)
    os.fchmod(fd, FILE_MODE)
    return fd


def seal_data_dir(data_dir: Path) -> None:
    """Make an install's data directory private: the directory 0700, every regular file at
    its top level (databases, sidecars, locks, tokens) 0600. Sub-directories keep their own
    modes (each owner module makes its own private, e.g. checkpoints, the layer store)."""
    private_dir(data_dir)
    with os.scandir(data_dir) as it:
        for entry in it:
            with contextlib.suppress(OSError):
                st = entry.stat(follow_symlinks=False)
                if stat.S_ISREG(st.st_mode) and stat.S_IMODE(st.st_mode) & 0o077:
                    os.chmod(entry.path, stat.S_IMODE(st.st_mode) & 0o700, follow_symlinks=False)
