"""CRIU's image files (protobuf): only the few fields read or patched here."""

from __future__ import annotations

import struct
from pathlib import Path

from dsec.errors import InternalError

# --- CRIU image files (protobuf; only the few fields we read or patch) --------------------


def _varint(b: bytes, i: int) -> tuple[int, int]:
    r = s = 0
    while True:
        c = b[i]
        i += 1
        r |= (c & 0x7F) << s
        s += 7
        if c < 0x80:
            return r, i


def _enc_varint(v: int) -> bytes:
    out = bytearray()
    while True:
        c, v = v & 0x7F, v >> 7
        out.append(c | (0x80 if v else 0))
        if not v:
            return bytes(out)


Field = tuple[int, int, int | bytes]


def _fields(b: bytes) -> list[Field]:
    out: list[Field] = []
    i = 0
    while i < len(b):
        key, i = _varint(b, i)
        num, wt = key >> 3, key & 7
        v: int | bytes
        if wt == 0:
            v, i = _varint(b, i)
        elif wt == 2:
            n, i = _varint(b, i)
            v, i = b[i : i + n], i + n
        elif wt == 1:
            v, i = b[i : i + 8], i + 8
        elif wt == 5:
            v, i = b[i : i + 4], i + 4
        else:
            raise ValueError(f"unsupported protobuf wire type {wt}")
        out.append((num, wt, v))
    return out


def _encode(fields: list[Field]) -> bytes:
    out = bytearray()
    for num, wt, v in fields:
        out += _enc_varint(num << 3 | wt)
        if wt == 0:
            assert isinstance(v, int)
            out += _enc_varint(v)
        elif wt == 2:
            assert isinstance(v, bytes)
            out += _enc_varint(len(v)) + v
        else:
            assert isinstance(v, bytes)
            out += v
    return bytes(out)


def _entries(data: bytes, magics: int) -> list[bytes]:
    """The protobuf entries of an image file: `magics` u32 magic words, then (u32 size, entry)*."""
    i, out = 4 * magics, []
    while i + 4 <= len(data):
        (n,) = struct.unpack_from("<I", data, i)
        out.append(data[i + 4 : i + 4 + n])
        i += 4 + n
    return out


def read_pstree(images: Path) -> list[tuple[int, int, list[int]]]:
    """(pid, ppid, thread ids) of every task in a dump, as the sandbox numbers them."""
    tasks = []
    for entry in _entries((images / "pstree.img").read_bytes(), 2):
        pid = ppid = 0
        threads: list[int] = []
        for num, wt, v in _fields(entry):
            if num == 1 and isinstance(v, int):
                pid = v
            elif num == 2 and isinstance(v, int):
                ppid = v
            elif num == 5:
                if isinstance(v, bytes) and wt == 2:  # packed
                    j = 0
                    while j < len(v):
                        t, j = _varint(v, j)
                        threads.append(t)
                elif isinstance(v, int):
                    threads.append(v)
        tasks.append((pid, ppid, threads))
    return tasks


def _patch_root_userns(images: Path, root_pid: int) -> None:
    """Make the tasks' user namespace CRIU's "root" one in the images, so a restore run
    inside the target sandbox's user namespace restores into it instead of creating one."""
    ids = _entries((images / f"ids-{root_pid}.img").read_bytes(), 2)[0]
    user_ns = next((v for num, _, v in _fields(ids) if num == 10), None)
    if not isinstance(user_ns, int):
        raise InternalError(f"CRIU images in {images} name no user namespace for task {root_pid}")
    path = images / "inventory.img"
    data = path.read_bytes()
    magic, n = struct.unpack_from("<II", data)
    body, rest = data[8 : 8 + n], data[8 + n :]
    out: list[Field] = []
    for num, wt, v in _fields(body):
        if num == 3 and isinstance(v, bytes):  # root_ids (task_kobj_ids_entry)
            v = _encode([(f, t, user_ns if f == 10 else x) for f, t, x in _fields(v)])
        out.append((num, wt, v))
    new = _encode(out)
    tmp = path.with_suffix(".tmp")
    tmp.write_bytes(struct.pack("<II", magic, len(new)) + new + rest)
    tmp.replace(path)
