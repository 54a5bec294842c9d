"""The trajectory log through the SDK: numbering, counts, export, replay after a client is killed."""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import textwrap

import pyarrow.parquet as pq
import pytest

from dsec import errors
from dsec.client import Client

pytestmark = [pytest.mark.root, pytest.mark.e2e]

ROLLOUT = textwrap.dedent(
    """
    import sys
    from dsec.client import Client

    sid, trajectory, steps = sys.argv[1], sys.argv[2], int(sys.argv[3])
    with Client() as c:
        sb = c.sandbox(sid)
        for i in range(steps):
            # a non-idempotent step: it appends a line every time it really runs
            cmd = f"echo step{i} >> /work/side_effects; wc -l < /work/side_effects"
            r = sb.exec(cmd, step=(trajectory, i))
            print(i, r.replayed, r.stdout.strip(), flush=True)
    """
)


def rollout(sid: str, trajectory: str, steps: int) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", ROLLOUT, sid, trajectory, str(steps)],
        stdout=subprocess.PIPE,
        text=True,
        env=dict(os.environ),
    )


def test_client_killed_mid_rollout_replays_without_running_twice(service):
    with Client() as c:
        sb = c.create("python")
        first = rollout(sb.id, "traj-A", 10)
        seen = [first.stdout.readline().split() for _ in range(5)]  # 5 steps acknowledged
        first.send_signal(signal.SIGKILL)
        first.wait()
        first.stdout.close()
        assert [s[0] for s in seen] == ["0", "1", "2", "3", "4"]

        again = rollout(sb.id, "traj-A", 10)
        out, _ = again.communicate(timeout=120)
        rows = [line.split() for line in out.splitlines()]
        assert [r[0] for r in rows] == [str(i) for i in range(10)]
        # the steps that ran before the kill come back from the log...
        assert all(r[1] == "True" for r in rows[:5])
        # ...with the very outputs they had, and every step ran exactly once
        assert [r[2] for r in rows[:5]] == [s[2] for s in seen]
        lines = sb.exec("cat /work/side_effects").stdout.split()
        ran = len(lines)
        assert lines == [f"step{i}" for i in range(ran)] and ran == 10

        # a different action at a logged step is a divergence, not a silent re-run
        with pytest.raises(errors.TrajectoryDivergence) as exc:
            sb.exec("echo something else", step=("traj-A", 3))
        assert exc.value.status == 409

        # the log: gap-free numbering, counts that add up, exports
        t = sb.trajectory()
        seqs = [e["seq"] for e in t["entries"]]
        assert seqs == list(range(1, len(seqs) + 1))
        stats = t["stats"]
        assert stats["acknowledged"] == stats["recorded"] == len(seqs) and stats["lost"] == 0
        tagged = [e for e in t["entries"] if e["trajectory"] == "traj-A"]
        assert [e["step"] for e in tagged] == list(range(10))
        jsonl = sb.trajectory_export("jsonl").decode().splitlines()
        assert [json.loads(x)["seq"] for x in jsonl] == seqs
        table = pq.read_table(io.BytesIO(sb.trajectory_export("parquet")))
        assert table.num_rows == len(seqs)
        sb.stop()


def test_session_and_file_steps_replay(service):
    with Client() as c:
        sb = c.create("python")
        sh = sb.session("bash")
        r1 = sh.run("N=$((${N:-0}+1)); echo $N", step=("traj-B", 0))
        r2 = sh.run("N=$((${N:-0}+1)); echo $N", step=("traj-B", 0))
        assert (r1.output, r1.replayed, r2.output, r2.replayed) == ("1\n", False, "1\n", True)
        sb.files.write("/work/cfg", "v1", step=("traj-B", 1))
        sb.files.write("/work/cfg", "v1", step=("traj-B", 1))  # replayed: no second write logged
        with pytest.raises(errors.TrajectoryDivergence):
            sb.files.write("/work/cfg", "v2", step=("traj-B", 1))
        assert sb.files.read("/work/cfg") == "v1"
        kinds = [e["kind"] for e in sb.trajectory()["entries"]]
        assert kinds == ["session", "file"]
        sb.stop()
