"""A tenant's Dockerfile, read before the builder (buildah) sees it: what it may not ask for is
refused, the images it builds FROM are listed (they are fetched under the pull policy, the
builder has no network), and heredocs are rewritten into a form buildah 1.28 reads.

This is not a Dockerfile interpreter: buildah parses and runs the file. We read only
instruction words and their flags, to refuse:

* `RUN --mount` of a type other than `tmpfs` or `bind`, and a `bind` with a `from=` or a
  source that is absolute or climbs with `..` (buildah resolves sources against the context,
  but its bind and cache mounts have had host escapes: CVE-2024-1753, CVE-2024-9675), and
  any other RUN flag (`--network`, `--security`);
* `ADD` of a URL or a git repository (the network, outside the build's policy);
* a FROM or `COPY --from` image whose name still holds a variable after the global ARGs
  and the build's args are substituted (the builder would decide what to fetch).

Heredocs (`RUN <<EOF`, `RUN python3 <<EOF`): buildah learned them in 1.33, Debian 12 ships
1.28. A RUN with heredocs becomes the exec form of the stage's shell with the whole text as
one script (`/bin/sh -c` reads `cmd <<EOF ... EOF` itself); a bare `RUN <<EOF` runs its body
(one starting with `#!` through that interpreter), as BuildKit does. `COPY <<EOF` is refused.
"""

from __future__ import annotations

import json
import re
import shlex
from dataclasses import dataclass, field

from dsec import errors

MAX_DOCKERFILE = 1 << 20
_HEREDOC = re.compile(r"<<(-?)(['\"]?)([A-Za-z_][A-Za-z0-9_]*)\2")
_VAR = re.compile(r"\$(?:\{([A-Za-z_][A-Za-z0-9_]*)(?::?-([^}]*))?\}|([A-Za-z_][A-Za-z0-9_]*))")


@dataclass
class Dockerfile:
    """The file as buildah gets it (`text`), and the images its stages start from or copy
    from (`bases`, as written after substitution; `scratch` and stage names left out)."""

    text: str
    bases: list[str] = field(default_factory=list)
    steps: int = 0


def _refuse(line: int, what: str) -> errors.InvalidRequest:
    return errors.InvalidRequest(f"Dockerfile line {line}: {what}", reason="dockerfile_refused")


def _substitute(text: str, args: dict[str, str]) -> str:
    def one(m: re.Match[str]) -> str:
        name = m[1] or m[3]
        if name in args:
            return args[name]
        return m[2] if m[2] is not None else m[0]

    return _VAR.sub(one, text)


def _logical_lines(text: str) -> list[tuple[int, str, list[str]]]:
    """(first line number, instruction text with continuations joined, heredoc bodies)."""
    raw = text.split("\n")
    escape = "\\"
    for ln in raw[:5]:
        m = re.match(r"#\s*escape\s*=\s*([\\`])\s*$", ln)
        if m:
            escape = m[1]
    out: list[tuple[int, str, list[str]]] = []
    i = 0
    while i < len(raw):
        start, cur = i + 1, raw[i]
        i += 1
        if not cur.strip() or cur.lstrip().startswith("#"):
            continue
        while cur.rstrip().endswith(escape) and i < len(raw):
            nxt = raw[i]
            i += 1
            if nxt.lstrip().startswith("#"):
                continue
            cur = cur.rstrip()[:-1] + nxt
        bodies: list[str] = []
        word = cur.split(None, 1)[0].upper()
        if word in ("RUN", "COPY", "ADD"):
            for m in _HEREDOC.finditer(cur):
                body: list[str] = []
                while i < len(raw) and (raw[i].lstrip("\t") if m[1] else raw[i]) != m[3]:
                    body.append(raw[i].lstrip("\t") if m[1] else raw[i])
                    i += 1
                if i >= len(raw):
                    raise _refuse(start, f"heredoc <<{m[3]} is never closed")
                i += 1
                bodies.append("\n".join(body) + "\n")
        out.append((start, cur, bodies))
    return out


def _flags(rest: str) -> tuple[list[str], str]:
    flags: list[str] = []
    while True:
        m = re.match(r"\s*(--[A-Za-z-]+(?:=\S*)?)", rest)
        if m is None:
            return flags, rest.strip()
        flags.append(m[1])
        rest = rest[m.end() :]


def _check_run_flags(ln: int, flags: list[str]) -> None:
    for flag in flags:
        name, _, value = flag.partition("=")
        if name != "--mount":
            raise _refuse(
                ln, f"RUN {name} is not allowed here (a build's RUN has no network and no host access)"
            )
        opts = dict((p.partition("=")[0].lower(), p.partition("=")[2]) for p in value.split(",") if p)
        kind = opts.get("type", "bind")
        if kind == "tmpfs":
            continue
        if kind != "bind":
            raise _refuse(
                ln, f"RUN --mount type={kind} is not allowed; use type=bind (from the context) or tmpfs"
            )
        src = opts.get("source", opts.get("src", "."))
        if "from" in opts or src.startswith("/") or ".." in src.split("/"):
            raise _refuse(
                ln, "RUN --mount type=bind takes a relative source inside the context, without from= or '..'"
            )


def _heredoc_run(shell: list[str], rest: str, bodies: list[str]) -> str:
    head = rest.strip()
    if _HEREDOC.fullmatch(head) and len(bodies) == 1:  # bare `RUN <<EOF`: the body is the script
        body = bodies[0]
        if body.startswith("#!"):
            interp = body.split("\n", 1)[0][2:].split()
            script = body.split("\n", 1)[1] if "\n" in body else ""
            return "RUN " + json.dumps([*interp, "-c", script])
        return "RUN " + json.dumps([*shell, body])
    script = head
    for m, body in zip(_HEREDOC.finditer(head), bodies, strict=False):
        script += "\n" + body + m[3]
    return "RUN " + json.dumps([*shell, script + "\n"])


class _Reader:
    """What `prepare` keeps from line to line: the global ARGs, the stage names, the shell."""

    def __init__(self, build_args: dict[str, str]) -> None:
        self.build_args, self.global_args = build_args, dict[str, str]()
        self.stages: set[str] = set()
        self.shell = ["/bin/sh", "-c"]
        self.out = Dockerfile(text="")
        self.seen_from = False

    def image(self, ln: int, written: str, what: str) -> None:
        """A FROM's or COPY --from's image: listed unless scratch, a stage or a stage number."""
        ref = _substitute(written, {**self.global_args, **self.build_args})
        if "$" in ref or not ref:
            raise _refuse(ln, f"{what} {written!r} does not name an image once ARGs are set")
        if ref.lower() != "scratch" and ref not in self.stages and not ref.isdigit():
            self.out.bases.append(ref)

    def from_(self, ln: int, args: str) -> None:
        self.seen_from, self.shell = True, ["/bin/sh", "-c"]
        parts = args.split()
        self.image(ln, parts[0] if parts else "", "FROM")
        if len(parts) >= 3 and parts[1].upper() == "AS":
            self.stages.add(parts[2])

    def run(self, ln: int, cur: str, flags: list[str], args: str, bodies: list[str]) -> str:
        _check_run_flags(ln, flags)
        if bodies and flags:
            raise _refuse(ln, "a RUN with heredocs takes no flags here")
        return _heredoc_run(self.shell, args, bodies) if bodies else cur

    def copy(self, ln: int, word: str, flags: list[str], args: str, bodies: list[str]) -> None:
        if bodies:
            raise _refuse(ln, f"{word} <<heredoc is not supported; put the file in the context")
        if word == "ADD" and re.search(r"(^|\s)(\S+://|git@)", args):
            raise _refuse(ln, "ADD of a URL or git repository is network: fetch it into the context first")
        for flag in flags:
            if flag.startswith("--from="):
                self.image(ln, flag[7:], "COPY --from")

    def line(self, ln: int, cur: str, bodies: list[str]) -> str:
        word, _, rest = cur.strip().partition(" ")
        word = word.upper()
        flags, args = _flags(rest)
        if word == "ARG" and not self.seen_from:
            for a in shlex.split(args):
                k, eq, v = a.partition("=")
                self.global_args[k] = self.build_args.get(k, v if eq else "")
        elif word == "FROM":
            self.from_(ln, args)
        elif word == "SHELL":
            try:
                self.shell = json.loads(args)
            except ValueError:
                raise _refuse(ln, "SHELL takes a JSON array") from None
        elif word == "RUN":
            cur = self.run(ln, cur, flags, args, bodies)
        elif word in ("ADD", "COPY"):
            if bodies:
                raise _refuse(ln, f"{word} <<heredoc is not supported; put the file in the context")
            if word == "ADD" and re.search(r"(^|\s)(\S+://|git@)", args):
                raise _refuse(
                    ln, "ADD of a URL or git repository is network: fetch it into the context first"
                )
            for flag in flags:
                if flag.startswith("--from="):
                    self.image(ln, flag[7:], "COPY --from")
        if word in _STEPS:
            self.out.steps += 1
        return cur


_STEPS = frozenset({
    "RUN", "COPY", "ADD", "ENV", "WORKDIR", "USER", "CMD", "ENTRYPOINT", "LABEL", "EXPOSE", "ARG", "SHELL",
    "VOLUME", "STOPSIGNAL", "HEALTHCHECK", "ONBUILD", "FROM", "MAINTAINER",
})  # fmt: skip


def prepare(text: str, build_args: dict[str, str]) -> Dockerfile:
    """Check `text` and rewrite it for buildah (see the module)."""
    if len(text.encode()) > MAX_DOCKERFILE:
        raise errors.PayloadTooLarge(f"the Dockerfile is over {MAX_DOCKERFILE >> 10} KiB")
    reader = _Reader(build_args)
    lines = [reader.line(ln, cur, bodies) for ln, cur, bodies in _logical_lines(text)]
    if not reader.seen_from:
        raise errors.InvalidRequest("the Dockerfile has no FROM", reason="dockerfile_refused")
    reader.out.text = "\n".join(lines) + "\n"
    return reader.out
