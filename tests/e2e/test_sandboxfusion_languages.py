"""Every language of the `code` image through the real `sandbox-fusion` client: a passing
program (stdin "6 7" -> "42") and a failing one each; a compiled language's failure is a
compile error (SandboxFusion's CompileError: no run, the compiler's output), an interpreted
one's a failing run. All calls go to one service's two warm workers, a few at a time."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest

pytestmark = [pytest.mark.root, pytest.mark.e2e]

# language -> (passing program, failing program, what the failure's output shows)
PROGRAMS: dict[str, tuple[str, str, str]] = {
    "python": ("a, b = map(int, input().split())\nprint(a * b)", "raise ValueError('boom')", "boom"),
    "pytest": (
        "def test_mul():\n    assert 6 * 7 == 42\n",
        "def test_mul():\n    assert 6 * 7 == 43\n",
        "1 failed",
    ),
    "bash": ("read a b\necho $((a * b))", "echo boom >&2\nexit 3", "boom"),
    "c": (
        '#include <stdio.h>\nint main(){int a,b;scanf("%d %d",&a,&b);printf("%d\\n",a*b);return 0;}',
        "int main( {",
        "error",
    ),
    "cpp": (
        "#include <iostream>\nint main(){int a,b;std::cin>>a>>b;std::cout<<a*b<<std::endl;}",
        "int main() { return x; }",
        "was not declared in this scope",
    ),
    "nodejs": (
        "const [a, b] = require('fs').readFileSync(0, 'utf8').trim().split(' ').map(Number);\n"
        "console.log(a * b);",
        "throw new Error('boom');",
        "boom",
    ),
    "typescript": (
        "interface P { a: number; b: number }\n"
        "const [a, b]: number[] = require('fs').readFileSync(0, 'utf8').trim().split(' ').map(Number);\n"
        "const p: P = { a, b };\nconsole.log(p.a * p.b);",
        "const f = (x: number): number => { throw new Error('boom ' + x); };\nf(1);",
        "boom 1",
    ),
    "java": (
        "import java.util.Scanner;\nimport org.javatuples.Pair;\n"
        "public class Main { public static void main(String[] args) {\n"
        "  Scanner s = new Scanner(System.in);\n"
        "  Pair<Integer, Integer> p = Pair.with(s.nextInt(), s.nextInt());\n"
        "  System.out.println(p.getValue0() * p.getValue1()); } }",
        'public class Main { public static void main(String[] args) { int x = "s"; } }',
        "incompatible types",
    ),
    "go": (
        'package main\nimport "fmt"\nfunc main() { var a, b int; fmt.Scan(&a, &b); fmt.Println(a * b) }',
        "package main\nfunc main() { x := 1 }",
        "declared but not used",
    ),
    "rust": (
        "use std::io::Read;\nfn main() { let mut s = String::new(); std::io::stdin().read_to_string(&mut s)"
        ".unwrap();\n let v: Vec<i64> = s.split_whitespace().map(|x| x.parse().unwrap()).collect();\n"
        ' println!("{}", v[0] * v[1]); }',
        'fn main() { let x: i32 = "s"; }',
        "mismatched types",
    ),
    "lua": (
        "local lu = require('luaunit')\nlocal a, b = io.read('*n', '*n')\nprint(a * b)",
        "error('boom')",
        "boom",
    ),
    "R": (
        'x <- scan(file("stdin"), quiet = TRUE)\ncat(x[1] * x[2], "\\n", sep = "")',
        'stop("boom")',
        "boom",
    ),
    "perl": ("my ($a, $b) = split ' ', <STDIN>;\nprint $a * $b, \"\\n\";", 'die "boom\\n";', "boom"),
    "ruby": (
        "require 'test/unit/assertions'\na, b = gets.split.map(&:to_i)\nputs a * b",
        "raise 'boom'",
        "boom",
    ),
    "php": (  # without the opening tag: SandboxFusion adds it
        "$x = array_map('intval', explode(' ', trim(fgets(STDIN))));\necho $x[0] * $x[1], \"\\n\";",
        "<?php\nthrow new Exception('boom');",
        "boom",
    ),
    "scala": (
        "object Main { def main(args: Array[String]): Unit = {\n"
        '  val Array(a, b) = scala.io.StdIn.readLine().split(" ").map(_.toInt); println(a * b) } }',
        'object Main { def main(args: Array[String]): Unit = { val x: Int = "s" } }',
        "type mismatch",
    ),
    "kotlin_script": (
        'val (a, b) = readLine()!!.split(" ").map { it.toInt() }\nprintln(a * b)',
        'error("boom")',
        "boom",
    ),
    "csharp": (
        "using System;\nclass P { static void Main() { var p = Console.ReadLine().Split(' ');\n"
        "  Console.WriteLine(int.Parse(p[0]) * int.Parse(p[1])); } }",
        'class P { static void Main() { int x = "s"; } }',
        "CS0029",
    ),
}
COMPILED = {"c", "cpp", "java", "go", "rust", "scala", "csharp"}


@pytest.fixture(scope="module")
def results(service) -> dict[tuple[str, bool], Any]:
    """Every program run once, a few at a time on the service's two workers."""
    import sandbox_fusion as sf

    endpoint = f"{service.url}/sandboxfusion/{service.token}"

    def run(key: tuple[str, bool]) -> Any:
        language, passing = key
        body = {"code": PROGRAMS[language][0 if passing else 1], "language": language, "stdin": "6 7\n"}
        if language == "c":  # dsec's own: the client's model does not list it, its wire is the same
            r = httpx.post(f"{endpoint}/run_code", json={**body, "compile_timeout": 10}, timeout=300)
            return sf.RunCodeResponse(**r.json())
        req = sf.RunCodeRequest(**body, run_timeout=20)
        return sf.run_code(req, endpoint=endpoint, max_attempts=1, client_timeout=300)

    keys = [(lang, passing) for lang in PROGRAMS for passing in (True, False)]
    with ThreadPoolExecutor(4) as pool:
        return dict(zip(keys, pool.map(run, keys), strict=True))


def test_every_available_language_is_tested(service):
    listing = httpx.get(
        f"{service.url}/v1/fncall/languages", headers={"Authorization": f"Bearer {service.token}"}
    ).json()
    assert set(listing["available"]) == set(PROGRAMS)
    assert {name for name, v in listing["available"].items() if v["compiled"]} == COMPILED
    assert {"julia", "lean"} <= set(listing["unavailable"])


@pytest.mark.parametrize("language", sorted(PROGRAMS))
def test_language_passes_and_fails(results, language):
    import sandbox_fusion as sf

    ok, bad = results[(language, True)], results[(language, False)]
    assert ok.status == sf.RunStatus.Success, ok
    assert ok.run_result.return_code == 0
    if language == "pytest":
        assert "1 passed" in ok.run_result.stdout
    else:
        assert ok.run_result.stdout.strip() == "42", ok.run_result
    assert (ok.compile_result is not None) == (language in COMPILED)
    assert bad.status == sf.RunStatus.Failed, bad
    mapping = sf.SummaryMapping(CompileFailed="CE", RunFailed="RE", Failed="F")
    if language in COMPILED:  # a compile error: no run, the compiler's output
        assert bad.run_result is None and bad.compile_result.return_code != 0, bad
        assert PROGRAMS[language][2] in bad.compile_result.stdout + bad.compile_result.stderr, bad
        assert sf.summary_run_code_result(bad, mapping) == "CE"
    else:
        assert bad.run_result.return_code != 0, bad
        assert PROGRAMS[language][2] in bad.run_result.stdout + bad.run_result.stderr, bad
        assert sf.summary_run_code_result(bad, mapping) == "RE"


def test_unavailable_language_is_refused_by_name(service):
    r = httpx.post(
        f"{service.url}/run_code?token={service.token}", json={"code": "println(1)", "language": "julia"}
    )
    err = r.json()["error"]
    assert r.status_code == 400 and "'julia' is not available" in err["message"], err
    assert "Debian" in err["message"] and err["details"]["reason"] == "language_unavailable"


def test_scala_without_an_object_is_a_compile_error(service):
    import sandbox_fusion as sf

    endpoint = f"{service.url}/sandboxfusion/{service.token}"
    r = sf.run_code(sf.RunCodeRequest(code="println(1)", language="scala"), endpoint=endpoint, max_attempts=1)
    assert r.status == sf.RunStatus.Failed and r.run_result is None
    assert r.compile_result.stderr == "Object name not found."
