"""Which group a confined QEMU is given to open /dev/kvm (dsec.backends.qemu.kvm_group): only a
non-root group with read-write access; a root-only /dev/kvm means no KVM for sandboxes (their
QEMU runs as the sandbox's own unprivileged uid)."""

from __future__ import annotations

import os
import stat

import pytest

from dsec.backends import qemu


@pytest.mark.parametrize(
    ("mode", "gid", "want"),
    [(0o660, 108, 108), (0o666, 108, 108), (0o600, 108, None), (0o640, 108, None), (0o660, 0, None)],
)
def test_kvm_group(monkeypatch: pytest.MonkeyPatch, mode: int, gid: int, want: int | None) -> None:
    real = os.stat

    def fake(path: str, *a: object, **kw: object) -> os.stat_result:
        if path == "/dev/kvm":
            fields = list(real("/dev/null"))
            fields[stat.ST_MODE], fields[stat.ST_GID] = stat.S_IFCHR | mode, gid
            return os.stat_result(fields)
        return real(path, *a, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(qemu.os, "stat", fake)
    assert qemu.kvm_group() == want
