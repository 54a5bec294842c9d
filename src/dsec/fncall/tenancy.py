"""Which project's workers serve a call: fncall workers are never shared across projects."""

from __future__ import annotations

from dsec.iam.store import IAM, Principal

ANONYMOUS = "_anonymous"  # the SandboxFusion endpoints with authentication turned off
PRINCIPAL = "principal:"  # workers of a principal with no project: f"{PRINCIPAL}{id}"


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
    return f"{PRINCIPAL}{p.id}"


def check_tier(iam: IAM, project: str, backend: str) -> None:
    """The tier policy (allowed_backends) of the project a call runs for, checked as a
    sandbox create checks it, admins' calls too: `forbidden` when it excludes `backend`.
    Workers keyed by a principal or anonymous belong to no project, so no policy limits them
    (neither name can be a project's: project names have no ':' and do not start with '_')."""
    if project == ANONYMOUS or project.startswith(PRINCIPAL):
        return
    iam.check_backend(project, backend)
