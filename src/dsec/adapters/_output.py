"""How adapters render command results as text for a model."""

from __future__ import annotations


def clip(text: str, limit: int) -> str:
    """``text`` cut to ``limit`` characters, keeping head and tail, with a marker of what was cut."""
    if limit <= 0 or len(text) <= limit:
        return text
    marker = f"\n...[{len(text) - limit} characters cut]...\n"
    keep = max(limit - len(marker), 0)
    head = keep // 2
    return text[:head] + marker + text[len(text) - (keep - head) :]


def render(
    stdout: str,
    stderr: str = "",
    *,
    exit_code: int = 0,
    error: str | None = None,
    timed_out: bool = False,
    timeout: float | None = None,
    limit: int = 4096,
) -> str:
    """One text block: stdout, then stderr / traceback, then a status line when the command failed."""
    parts = [clip(stdout, limit)] if stdout else []
    if stderr:
        parts.append("[stderr]\n" + clip(stderr, limit))
    if error:
        parts.append(clip(error, limit))
    if timed_out:
        parts.append(f"[timed out after {timeout:g} s]" if timeout else "[timed out]")
    elif exit_code != 0 and not error:
        parts.append(f"[exit code {exit_code}]")
    return "\n".join(p.rstrip("\n") for p in parts)
