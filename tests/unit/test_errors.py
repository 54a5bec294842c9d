"""The error tree in errors.py's docstring is the whole tree: every class, under its parent,
with its HTTP status when it has one of its own."""

from __future__ import annotations

import re

from dsec import errors


def classes() -> list[type[errors.DsecError]]:
    return [
        c
        for c in vars(errors).values()
        if isinstance(c, type) and issubclass(c, errors.DsecError) and c.__module__ == errors.__name__
    ]


def drawing() -> list[tuple[int, str, str]]:
    """(column of the name, class name, the line) for each line of the tree."""
    out = []
    for ln in (errors.__doc__ or "").splitlines():
        m = re.search(r"(?:[├└]── |^\s{4})([A-Z][A-Za-z_]+)", ln)
        if m and ("── " in ln or m.group(1) == "DsecError"):
            out.append((m.start(1), m.group(1), ln))
    return out


def test_every_error_class_is_drawn_under_its_parent_with_its_status():
    tree = drawing()
    drawn = [name for _, name, _ in tree]
    names = {c.__name__ for c in classes()}
    assert names == set(drawn), f"missing: {sorted(names - set(drawn))}, extra: {sorted(set(drawn) - names)}"
    for i, (col, name, line) in enumerate(tree):
        c = getattr(errors, name)
        status = re.search(r"\((\d{3})", line)
        if status:
            assert int(status.group(1)) == c.status, (name, line)
        if c is errors.DsecError:
            continue
        parent = next(n for pc, n, _ in reversed(tree[:i]) if pc < col)
        assert parent == c.__bases__[0].__name__, (name, "drawn under", parent)
        if not status:
            assert c.status == c.__bases__[0].status, (name, "draw its own status")


def test_wire_codes_are_unique():
    codes = [c.code for c in classes() if c is not errors.DsecError]
    assert len(codes) == len(set(codes)), sorted(codes)


def test_a_grader_that_could_not_run_is_its_own_error_not_a_transient_one():
    """`grader_unavailable` (issue #25): an environment fault a trainer must not score, and not
    `unavailable` (the SDK would move to another apiserver and send a verify again)."""
    body = {"error": {"code": "grader_unavailable", "message": "the vault is gone"}}
    err = errors.error_from_wire(503, body)
    assert type(err) is errors.GraderUnavailable and err.message == "the vault is gone"
    assert not isinstance(err, errors.Unavailable) and not err.retryable
    wire = errors.GraderUnavailable("x").to_wire()
    assert wire == {"error": {"code": "grader_unavailable", "message": "x"}}
