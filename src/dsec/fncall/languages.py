"""The languages of stateless code runs: how each compiles and runs, after SandboxFusion.

Each entry follows SandboxFusion's runner for that language (sandbox/runners/major.py and
minor.py): the file the code is written to, the compile command (None: none), the run
command, all run inside the worker sandbox by the fncall runner, the compile as the call's
unprivileged uid like the run. The runner gets a call's plan (`plan()`) with its request,
so it knows no language itself; a language is its Debian packages in the `code` recipe
(layers/recipes/code.toml) and an entry here.

Compilers of the JVM languages, Rust and Go take longer than SandboxFusion's 10 s default
compile timeout on a small edge (2 cores), and SandboxFusion's clients always send that
default: a language's `min_compile_timeout` raises the compile timeout a call gives. A
language SandboxFusion runs that the image cannot (Debian does not package it) is listed in
`UNAVAILABLE` with the reason, and a call in it is refused naming that reason.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from dsec import errors

JAVATUPLES = "/usr/share/java/javatuples.jar"  # libjavatuples-java: SandboxFusion's class path has it


@dataclass(frozen=True)
class Language:
    """How one language compiles and runs in the worker's scratch directory."""

    source: str  # the file the code is written to
    run: tuple[str, ...]  # "PYTHON" / "PYTEST": the runner's in-process fast paths
    compile: tuple[str, ...] | None = None
    min_compile_timeout: float = 0.0  # the compile timeout is at least this (seconds)
    env: dict[str, str] = field(default_factory=dict)
    packages: tuple[str, ...] = ()  # what brings it into the `code` image (Debian bookworm)
    # code -> (code to write, run argv) or an error message as SandboxFusion's compile error
    prepare: Callable[[Language, str, list[str]], tuple[str, tuple[str, ...]] | str] | None = None


def _php(lang: Language, code: str, files: list[str]) -> tuple[str, tuple[str, ...]]:
    code = code.lstrip()  # SandboxFusion's ensure_php_tag_in_string
    return (code if code.startswith("<?php") else "<?php\n" + code), lang.run


_SCALA_OBJECT = re.compile(r"object\s+(\w+)(\s*)|(\s+extends\s+\w+\s*){", re.DOTALL | re.MULTILINE)


def _scala(lang: Language, code: str, files: list[str]) -> tuple[str, tuple[str, ...]] | str:
    # SandboxFusion's find_scala_classname: the first `object X`; none is a compile error.
    m = _SCALA_OBJECT.search(code)
    if m is None or not m.group(1):
        return "Object name not found."
    return code, (*lang.run, m.group(1))


def _java_classpath(lang: Language, code: str, files: list[str]) -> tuple[str, tuple[str, ...]]:
    # SandboxFusion: -cp .:javatuples-1.2.jar plus every .jar the call brings
    cp = ":".join([".", JAVATUPLES, *(f for f in files if f.endswith(".jar"))])
    return code, tuple(cp if a == "CP" else a for a in lang.run)


# A small edge: compilers get one GC thread and the quick JIT (they run briefly); warnings of
# the JVM (Debian's kotlinc passes the deprecated -noverify) are not the program's output.
_JVM = ("-J-XX:+UseSerialGC", "-J-XX:TieredStopAtLevel=1", "-J-XX:-PrintWarnings")
# esbuild strips the types and runs nothing else, as SandboxFusion's tsx does (tsx is esbuild)
_TS = (
    "esbuild --log-level=warning --format=cjs --platform=node --outfile=main.ts.js main.ts"
    " && exec node main.ts.js"
)

LANGUAGES: dict[str, Language] = {
    "python": Language("main.py", ("PYTHON",), packages=("python3", "python3-numpy", "python3-pandas")),
    "pytest": Language("test_main.py", ("PYTEST",), packages=("python3-pytest",)),
    "bash": Language("main.sh", ("bash", "main.sh"), packages=("bash",)),
    "c": Language(
        "main.c", ("./main",), ("gcc", "-O2", "-std=c11", "-o", "main", "main.c", "-lm"), packages=("gcc",)
    ),
    "cpp": Language(
        "main.cpp",
        ("./test",),
        ("g++", "-std=c++17", "main.cpp", "-o", "test", "-lpthread"),
        packages=("g++",),
    ),
    "nodejs": Language("main.js", ("node", "main.js"), packages=("nodejs",)),
    "typescript": Language("main.ts", ("sh", "-c", _TS), packages=("esbuild", "nodejs")),
    "java": Language(
        "Main.java",
        ("java", "-XX:+UseSerialGC", "-cp", "CP", "-ea", "Main"),
        ("javac", *_JVM, "-cp", f".:{JAVATUPLES}", "Main.java"),
        min_compile_timeout=30,
        packages=("default-jdk-headless", "libjavatuples-java"),
        prepare=_java_classpath,
    ),
    "go": Language(
        "main.go",
        ("./out",),
        ("go", "build", "-o", "out", "main.go"),
        min_compile_timeout=30,
        env={"GOPROXY": "off"},  # no module downloads: a missing import fails at once
        packages=("golang-go",),
    ),
    "rust": Language(
        "main.rs",
        ("./test",),
        ("rustc", "main.rs", "-o", "test"),
        min_compile_timeout=30,
        packages=("rustc",),
    ),
    "lua": Language("main.lua", ("lua5.2", "main.lua"), packages=("lua5.2", "lua-unit")),
    "R": Language("main.R", ("Rscript", "main.R"), packages=("r-base-core",)),
    "perl": Language("main.pl", ("perl", "main.pl"), packages=("perl",)),
    "ruby": Language("main.rb", ("ruby", "main.rb"), packages=("ruby", "ruby-test-unit")),
    "php": Language("main.php", ("php", "-f", "main.php"), packages=("php-cli",), prepare=_php),
    "scala": Language(
        "main.scala",
        ("scala", "-J-XX:+UseSerialGC"),
        ("scalac", *_JVM, "main.scala"),
        min_compile_timeout=60,
        packages=("scala",),
        prepare=_scala,
    ),
    # Debian's Kotlin (1.3) runs scripts through kotlinc (its `kotlin` does not yet): no compile
    # stage, as SandboxFusion's `kotlin main.kts` (nor the quick JIT: the program runs in it)
    "kotlin_script": Language(
        "main.kts",
        ("kotlinc", "-J-XX:+UseSerialGC", "-J-XX:-PrintWarnings", "-script", "main.kts"),
        packages=("kotlin",),
    ),
    "csharp": Language(
        "main.cs",
        ("mono", "main.exe"),
        ("mcs", "-out:main.exe", "main.cs"),
        min_compile_timeout=20,
        packages=("mono-mcs", "mono-runtime"),
    ),
}

# SandboxFusion's languages that the `code` image does not run, and why.
UNAVAILABLE: dict[str, str] = {
    "julia": "Debian packages no Julia (bookworm nor trixie)",
    "lean": "Debian packages no Lean 4 (its toolchain manager elan downloads it at run time)",
    "swift": "Debian bookworm packages no Swift compiler",
    "python2": "Debian bookworm packages no Python 2",
    "python_gpu": "needs a GPU, which fncall workers do not have",
    "cuda": "needs a GPU and NVIDIA's toolkit, which Debian main does not carry",
    "go_test": "needs SandboxFusion's Go module dependencies (testify, zap, ...), not in the image",
    "junit": "needs the JUnit console launcher jars SandboxFusion ships, not in the image",
    "jest": "needs jest from npm, which Debian does not package",
    "react": "needs React and jest from npm, which Debian does not package",
    "gtest": "Debian packages GoogleTest (libgtest-dev), but the image does not have it yet",
    "D_ut": "Debian packages a D compiler (ldc), but the image does not have it yet",
    "verilog": "Debian packages Icarus Verilog (iverilog), but the image does not have it yet",
    "racket": "Debian's racket is 337 MB installed: left out of the image for size",
    "sql": "SandboxFusion has no runner for it",
}


def listing() -> dict[str, Any]:
    """What `GET /v1/fncall/languages` answers: the languages of the `code` image and the rest."""
    return {
        "available": {
            name: {
                "compiled": lang.compile is not None,
                "min_compile_timeout": lang.min_compile_timeout,
                "packages": list(lang.packages),
            }
            for name, lang in LANGUAGES.items()
        },
        "unavailable": dict(UNAVAILABLE),
    }


def refusal(language: str) -> errors.InvalidRequest:
    """The 400 for a language the image does not run: unavailable (named, with the reason) or unknown."""
    available = ", ".join(sorted(LANGUAGES))
    if language in UNAVAILABLE:
        return errors.InvalidRequest(
            f"language {language!r} is not available: {UNAVAILABLE[language]}; available: {available}",
            reason="language_unavailable",
            language=language,
            available=sorted(LANGUAGES),
        )
    return errors.InvalidRequest(
        f"unsupported language {language!r}; supported: {available}",
        reason="unsupported_language",
        language=language,
        available=sorted(LANGUAGES),
    )


def plan(language: str, code: str, files: list[str], compile_timeout: float) -> dict[str, Any]:
    """What the runner needs to run `code` in `language`: the source file, the code to write,
    the compile and run argv, the compile timeout and extra environment; with `"error"` set
    instead of a compile when the code cannot be compiled at all (SandboxFusion's answer)."""
    lang = LANGUAGES.get(language)
    if lang is None:
        raise refusal(language)
    run = lang.run
    if lang.prepare is not None:
        prepared = lang.prepare(lang, code, files)
        if isinstance(prepared, str):
            return {"error": prepared}
        code, run = prepared
    return {
        "source": lang.source,
        "code": code,
        "compile": list(lang.compile) if lang.compile is not None else None,
        "run": list(run),
        "compile_timeout": max(compile_timeout, lang.min_compile_timeout),
        "env": dict(lang.env),
    }
