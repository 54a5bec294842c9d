"""Error messages quote the tail of a log some of which a sandbox writes (a microVM guest's
console): only the tail may be read, however big the log grew."""

from __future__ import annotations

from pathlib import Path

from dsec.backends.base import log_tail


def test_only_the_tail_of_a_huge_log_is_read(tmp_path: Path) -> None:
    log = tmp_path / "console.log"
    with open(log, "wb") as f:
        f.seek(1 << 40)  # 1 TiB of hole before it, sparse: reading it whole would never finish
        f.write(b"\n  kernel panic: the end  \n")
    assert log_tail(log, 300).endswith("kernel panic: the end")
    assert len(log_tail(log, 300)) <= 300


def test_a_missing_or_short_log(tmp_path: Path) -> None:
    assert log_tail(tmp_path / "absent", 300) == ""
    (tmp_path / "short").write_bytes(b"ok\xff\n")
    assert log_tail(tmp_path / "short", 300) == "ok\ufffd"
