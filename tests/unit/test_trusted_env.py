"""A trusted command's env takes the image's ENV but nothing in it that leads to the agent's
files (the task directories) or loads code: an image's own PATH into its workdir would run
the agent's binaries as the grader."""

from __future__ import annotations

from dsec.edge.trusted import DEFAULT_PATH, clean_env

DIRS = ["/app", "/work"]


def test_the_image_toolchain_is_kept() -> None:
    env = clean_env({}, {"PATH": "/opt/conda/bin:/usr/bin", "JAVA_HOME": "/opt/jdk", "LANG": "C.UTF-8"}, DIRS)
    assert env == {
        "PATH": "/opt/conda/bin:/usr/bin",
        "JAVA_HOME": "/opt/jdk",
        "LANG": "C.UTF-8",
        "HOME": "/tmp",
    }
    assert clean_env({}, None, DIRS)["PATH"] == DEFAULT_PATH


def test_nothing_of_the_image_env_leads_into_the_task_dirs() -> None:
    image = {
        "PATH": "/app/node_modules/.bin:/work/bin:node_modules/.bin:.:/usr/local/bin:/usr/bin",
        "PYTHONPATH": "/app:/opt/lib/python",
        "LD_LIBRARY_PATH": "/work/lib:/usr/local/cuda/lib64",
        "CONFIG_FILE": "/app/../app/conf.yml",
        "SETTINGS": "x=/work/s.py",
        "RELATIVE": "./run.sh",
        "NODE_OPTIONS": "--require /opt/trace.js",
        "JAVA_TOOL_OPTIONS": "-javaagent:agent.jar",
        "BASH_ENV": "/etc/bashrc",
        "LD_PRELOAD": "/usr/lib/libfast.so",
        "APP_HOME": "/application",  # (a sibling of /app, not in it)
    }
    env = clean_env({}, image, DIRS)
    assert env["PATH"] == "/usr/local/bin:/usr/bin"
    assert env["PYTHONPATH"] == "/opt/lib/python"
    assert env["LD_LIBRARY_PATH"] == "/usr/local/cuda/lib64"
    for gone in (
        "CONFIG_FILE",
        "SETTINGS",
        "RELATIVE",
        "NODE_OPTIONS",
        "JAVA_TOOL_OPTIONS",
        "BASH_ENV",
        "LD_PRELOAD",
    ):
        assert gone not in env, gone
    assert env["APP_HOME"] == "/application"
    # a path list wholly in the task dirs is dropped (not left empty: an empty PATH entry is the cwd)
    assert clean_env({}, {"PYTHONPATH": "/work"}, DIRS).get("PYTHONPATH") is None
    assert clean_env({}, {"PATH": "/work/bin"}, DIRS)["PATH"] == DEFAULT_PATH


def test_the_call_still_decides() -> None:
    """The caller (the trainer, not the agent) may set anything, even into a task dir."""
    env = clean_env({"PATH": "/work/bin:/usr/bin", "HOME": "/work"}, {"PATH": "/opt/bin"}, DIRS)
    assert env["PATH"] == "/work/bin:/usr/bin" and env["HOME"] == "/work"
