"""Round three's attack review (issue #25) on real components: what the first round's tests
of items 1, 2, 7 and 9 did not try, as a hostile sandbox process or tenant."""

from __future__ import annotations

import pytest

from dsec.models import ExecRequest, SandboxSpec

pytestmark = [pytest.mark.root, pytest.mark.asyncio]


# --- item 2: files on the host that a sandbox can write into ---------------------------------


async def test_a_guest_cannot_grow_its_console_file_on_the_host(edge):
    """ATTACK (worked): a microVM's serial console is a file of the edge's run tmpfs (host
    memory), written by QEMU, and the guest kernel printed a line there for every OOM kill
    ("Out of memory: Killed process ...", KERN_ERR): a sandbox looping on allocations grew it
    by ~160 bytes each, without bound, for as long as it lived. The guest kernel now prints
    only critical messages (its panic, the agent's last words) to the console."""
    sb = await edge.create(SandboxSpec(image="python", backend="microvm", memory_mb=64))
    console = edge.backends["microvm"].vms_dir / sb.id / "console.log"
    before = console.stat().st_size
    cmd = "for i in 1 2 3; do python3 -c 'b = bytearray(200 << 20)'; echo $?; done"
    r = await edge.exec(sb.id, ExecRequest(cmd=cmd, timeout=300))
    assert r.stdout.split() == ["137"] * 3  # each one killed by the guest's OOM killer
    assert console.stat().st_size == before, console.read_text(errors="replace")[-500:]
