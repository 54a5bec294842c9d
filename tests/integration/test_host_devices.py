"""Starting a sandbox leaves the host's device nodes alone.

The OCI runtime chowns the container process's stdio to the sandbox's root; the edge used
to start it with the host's /dev/null as stdin, so every create made the host's /dev/null
owned by uid 100000, and root inside a sandbox (which sees that very inode bind-mounted at
/dev/null) could chmod it and break every program on the host."""

from __future__ import annotations

import os

import pytest

from dsec.models import ExecRequest, SandboxSpec

pytestmark = [pytest.mark.root, pytest.mark.asyncio]


async def test_create_leaves_the_hosts_dev_null_to_root(edge) -> None:
    os.chown("/dev/null", 0, 0)  # repair a host an older edge left behind
    sb = await edge.create(SandboxSpec(image="python"))
    try:
        st = os.stat("/dev/null")
        assert (st.st_uid, st.st_gid) == (0, 0)
        cmd = "chmod 000 /dev/null; chown 0:0 /dev/null; echo x > /dev/null"
        r = await edge.exec(sb.id, ExecRequest(cmd=cmd))
        assert "Operation not permitted" in r.stderr
        assert os.stat("/dev/null").st_mode & 0o777 == 0o666
    finally:
        await edge.stop(sb.id)
