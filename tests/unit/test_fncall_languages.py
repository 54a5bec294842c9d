"""The languages table: SandboxFusion's per-language preparations, floors and refusals."""

from __future__ import annotations

import pytest

from dsec import errors
from dsec.compat.sandboxfusion import LANGUAGES as ACCEPTED
from dsec.fncall import languages

# SandboxFusion's languages (its RunCodeRequest's Literal)
SANDBOXFUSION = {
    "python", "cpp", "nodejs", "go", "go_test", "java", "php", "csharp", "bash", "typescript", "sql",
    "rust", "cuda", "lua", "R", "perl", "D_ut", "ruby", "scala", "julia", "pytest", "junit",
    "kotlin_script", "jest", "verilog", "python_gpu", "lean", "swift", "racket",
}  # fmt: skip


def test_every_sandboxfusion_language_is_available_or_says_why():
    assert not set(languages.LANGUAGES) & set(languages.UNAVAILABLE)
    assert set(languages.LANGUAGES) | set(languages.UNAVAILABLE) >= SANDBOXFUSION
    assert set(ACCEPTED) == set(languages.LANGUAGES) | set(languages.UNAVAILABLE)
    assert all(reason for reason in languages.UNAVAILABLE.values())


def test_plans_follow_sandboxfusion():
    p = languages.plan("php", "  echo 1;", [], 10)
    assert p["code"] == "<?php\necho 1;" and p["run"] == ["php", "-f", "main.php"]
    assert languages.plan("php", "<?php echo 1;", [], 10)["code"] == "<?php echo 1;"
    p = languages.plan("scala", "object Solution extends App { println(1) }", [], 10)
    assert p["run"][-1] == "Solution" and p["compile_timeout"] == 60  # raised to the floor
    assert languages.plan("scala", "println(1)", [], 10) == {"error": "Object name not found."}
    p = languages.plan("java", "class Main {}", ["lib/a.jar", "x.txt"], 120)
    assert f".:{languages.JAVATUPLES}:lib/a.jar" in p["run"] and p["compile_timeout"] == 120
    assert p["source"] == "Main.java" and p["compile"][0] == "javac"
    p = languages.plan("python", "print(1)", [], 10)
    assert p["compile"] is None and p["run"] == ["PYTHON"]


def test_refusals_name_the_language_and_why():
    with pytest.raises(errors.InvalidRequest, match="'julia' is not available: Debian") as e:
        languages.plan("julia", "println(1)", [], 10)
    assert e.value.to_wire()["error"]["details"]["reason"] == "language_unavailable"
    with pytest.raises(errors.InvalidRequest, match="unsupported language 'cobol'"):
        languages.plan("cobol", "x", [], 10)
    listing = languages.listing()
    assert listing["available"]["java"]["compiled"] and "julia" in listing["unavailable"]
