"""Wire-compatible endpoints for existing RL tooling (SandboxFusion, SWE-ReX)."""
