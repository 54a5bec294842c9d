"""Which project's workers serve a call: fncall workers are never shared across projects."""

from __future__ import annotations

from dsec.iam.store import IAM, Principal

ANONYMOUS = "_anonymous"  # the SandboxFusion endpoints with authentication turned off


def caller_project(iam: IAM, p: Principal, asked: str | None) -> str:
    """The project a call runs for: the one the caller asked for (it must be one of its
    own, or a descendant), else its first project; a principal with no project (an admin,
    say) gets workers of its own. Project names never contain ':', so no principal key can
    be a project's."""
    if asked is not None:
        iam.authorize(p, asked)
        return asked
    if p.projects:
        return p.projects[0]
    return f"principal:{p.id}"
