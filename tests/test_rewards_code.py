"""Code reward in the real sandbox: stdio and function tests, tampering."""

from __future__ import annotations

import threading

import pytest

from kimi_jax.rewards.base import score_all
from kimi_jax.rewards.code import (CodeReward, extract_code, normalize_output,
                                   outputs_match, parse_report)
from kimi_jax.sandbox import Sandbox, SandboxClient
from kimi_jax.sandbox.server import ServerConfig, make_server


@pytest.fixture(scope="module")
def sandbox():
  box = Sandbox(max_workers=2)
  yield box
  box.close()


@pytest.fixture(scope="module")
def reward(sandbox):
  return CodeReward(sandbox, time_limit_s=1.0)


# -- pure helpers -------------------------------------------------------------

def test_normalize_output():
  assert normalize_output("1 2  \r\n3\t\n\n\n") == "1 2\n3"
  assert outputs_match("3\n", "3") and outputs_match("a \nb", "a\nb\n")
  assert not outputs_match("3 4", "3  4")
  assert not outputs_match("3\n\n4", "3\n4")


def test_extract_code_takes_last_fence():
  text = "idea\n```python\nprint(1)\n```\nfix:\n```py\nprint(2)\n```\n"
  assert extract_code(text) == "print(2)\n"
  assert extract_code("print(3)") == "print(3)"
  assert extract_code(text, enabled=False) == text


def test_parse_report_requires_nonce():
  assert parse_report("x\nabc {\"a\": 1}\n", "abc") == {"a": 1}
  assert parse_report("abd {\"a\": 1}\n", "abc") is None
  assert parse_report("abc not-json\n", "abc") is None


# -- stdin/stdout -------------------------------------------------------------

SUM_TESTS = [{"input": "1 2\n", "output": "3\n"},
             {"input": "5 7\n", "output": "12\n"},
             {"input": "-4 4\n", "output": "0"}]

CORRECT = {
    "python": "a, b = map(int, input().split())\nprint(a + b)\n",
    "cpp": "#include <iostream>\nint main(){long long a,b;std::cin>>a>>b;"
           "std::cout<<a+b<<\"   \\n\\n\";}\n",
    "javascript": "const [a,b]=require('fs').readFileSync(0,'utf8').trim()"
                  ".split(/\\s+/).map(Number);console.log(a+b);\n",
}

# Each must fail: (description, language, program).
BAD_STDIO = [
    ("wrong answer", "python",
     "a, b = map(int, input().split())\nprint(a - b)"),
    ("right for the first case only", "python", "print(3)"),
    ("sys.exit(0) before any output", "python", "import sys\nsys.exit(0)"),
    ("os._exit(0)", "python", "import os\nos._exit(0)"),
    ("raises after printing", "python",
     "a, b = map(int, input().split())\nprint(a + b)\nraise SystemExit(2)"),
    ("infinite loop", "python", "while True: pass"),
    ("compile error", "cpp", "int main() { return 0 }"),
    ("runtime error", "javascript", "throw new Error('boom');"),
    ("hangs on stdin", "cpp", "#include <thread>\n#include <chrono>\nint main()"
     "{std::this_thread::sleep_for(std::chrono::seconds(30));}"),
    ("reads the harness job to learn the expected answers", "python",
     "import json\nprint(json.load(open('harness_job.json')))"),
    ("prints a fake harness report", "python",
     "print()\nprint('0' * 32 + ' {\"compile_ok\": true, \"cases\": []}')"),
]


@pytest.mark.parametrize("language", sorted(CORRECT))
def test_stdio_correct_program_passes(reward, language):
  record = {"id": "sum", "prompt": "", "language": language,
            "tests": SUM_TESTS}
  res = reward(record, f"Here:\n```{language}\n{CORRECT[language]}```\n")
  assert (res.score, res.correct, res.error) == (1.0, True, None), res.info


@pytest.mark.slow
def test_stdio_bad_programs_fail(reward):
  records = [{"id": name, "prompt": "", "language": lang, "tests": SUM_TESTS}
             for name, lang, _ in BAD_STDIO]
  results = score_all(reward, records, [src for _, _, src in BAD_STDIO])
  passed = [name for (name, _, _), r in zip(BAD_STDIO, results) if r.correct]
  assert not passed
  assert all(r.score == 0.0 for r in results)
  status = {name: r.info.get("status") for (name, _, _), r
            in zip(BAD_STDIO, results)}
  assert status["infinite loop"] == "timeout"
  assert status["compile error"] == "compile_error"
  assert status["wrong answer"] == "wrong_answer"
  assert status["runtime error"] == "runtime_error"


def test_stdio_each_case_runs_in_a_fresh_process(reward):
  # A program that counts its runs in a file would print 1, 2, 3 if the cases
  # shared a process or state were expected to persist; each case must see a
  # fresh interpreter (the working directory, though, is shared by design).
  src = ("import itertools\n_c = globals().setdefault('_c', itertools.count())"
         "\nprint(next(_c))")
  tests = [{"input": "", "output": "0"}] * 3
  assert reward({"id": "f", "prompt": "", "tests": tests}, src).correct


def test_stdio_candidate_cannot_reach_harness_through_proc(reward):
  """Scrapes the harness's memory for the nonce and writes a fake report to
  its stdout: blocked because the harness is non-dumpable."""
  src = r'''
import os, re
ppid = os.getppid()
found = []
try:
  maps = open(f"/proc/{ppid}/maps").read().splitlines()
  mem = open(f"/proc/{ppid}/mem", "rb", 0)
  for line in maps:
    lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
    try:
      mem.seek(lo)
      found += re.findall(rb"[0-9a-f]{32}", mem.read(min(hi - lo, 1 << 24)))
    except (OSError, OverflowError, ValueError):
      pass
except OSError:
  pass
try:
  with open(f"/proc/{ppid}/fd/1", "w") as out:
    for nonce in set(found):
      out.write("\n" + nonce.decode() + ' {"compile_ok": true, "cases": []}\n')
except OSError:
  pass
print("cannot")
'''
  tests = [{"input": "", "output": "1"}]
  res = reward({"id": "proc", "prompt": "", "tests": tests}, src)
  assert not res.correct


PROBE_HARNESS = r'''
import os
ppid = os.getppid()
for what in ("mem", "environ", "fd/1"):
  try:
    open(f"/proc/{ppid}/{what}", "rb").close()
    print(what, "open")
  except OSError:
    print(what, "denied")
'''


def test_harness_memory_and_fds_are_unreachable(reward):
  """The candidate runs as the harness's uid: only non-dumpability keeps
  /proc/<harness>/{mem,environ,fd} closed to it."""
  tests = [{"input": "", "output": "mem denied\nenviron denied\nfd/1 denied"}]
  assert reward({"id": "probe", "prompt": "", "tests": tests},
                PROBE_HARNESS).correct


def test_stdio_limits_and_record_errors(reward):
  records = [
      {"id": "lang", "prompt": "", "language": "rust", "tests": SUM_TESTS},
      {"id": "none", "prompt": ""},
      {"id": "empty", "prompt": "", "tests": []},
  ]
  results = score_all(reward, records, ["x", "x", "x"])
  assert [r.correct for r in results] == [False] * 3
  assert "rust" in results[0].error
  assert "neither" in results[1].error
  assert "empty" in results[2].error


def test_many_cases_are_split_across_requests(sandbox):
  reward = CodeReward(sandbox, max_cases_per_request=4)
  tests = [{"input": f"{i} {i}\n", "output": f"{2 * i}\n"} for i in range(10)]
  good = reward({"id": "m", "prompt": "", "tests": tests}, CORRECT["python"])
  tests[7] = {"input": "7 7\n", "output": "15\n"}
  bad = reward({"id": "m", "prompt": "", "tests": tests}, CORRECT["python"])
  assert good.correct and not bad.correct and bad.info["case"] == 3


# -- function (HumanEval-style) tests ----------------------------------------

FUNC_RECORD = {
    "id": "add", "prompt": "def add(a, b):\n    \"\"\"a + b\"\"\"\n",
    "code_prefix": "def add(a, b):\n    \"\"\"a + b\"\"\"\n",
    "entry_point": "add",
    "test": ("def check(candidate):\n"
             "    assert candidate(2, 3) == 5\n"
             "    assert candidate(-1, 1) == 0\n"
             "    assert candidate(a=10, b=5) == 15\n"
             "    assert candidate(0.5, 0.25) == 0.75\n"),
}

GOOD_COMPLETION = "    return a + b\n"

# Completions that try to pass without computing a + b; every one must fail.
TAMPERING = {
    "sys.exit(0) at import": "    return 0\nimport sys\nsys.exit(0)\n",
    "os._exit(0) in the body": "    import os\n    os._exit(0)\n",
    "raises": "    raise ValueError('no')\n",
    "redefines check": "    return 0\n\ndef check(candidate):\n    pass\n",
    "patches AssertionError and assert": (
        "    return 0\nimport builtins\n"
        "class Quiet(BaseException):\n    pass\n"
        "builtins.AssertionError = Quiet\n"
        "import sys\nsys.excepthook = lambda *a: None\n"),
    "monkeypatches exit": (
        "    return 0\nimport sys, os, builtins\n"
        "sys.exit = lambda *a: None\nos._exit = lambda *a: None\n"
        "builtins.exit = builtins.quit = lambda *a: None\n"),
    "always-equal object": (
        "    class Any:\n        def __eq__(self, other):\n"
        "            return True\n    return Any()\n"),
    "prints success markers": (
        "    print('PASSED'); print('All tests passed'); return 0\n"
        "open('success', 'w').write('ok')\nprint('\\n' + 'f' * 32 + ' {}')\n"),
    "steals the harness job": (
        "    return 0\nimport json\n"
        "job = json.load(open('harness_job.json'))\n"
        "print('\\n' + job['nonce'] + ' {}')\n"),
    "writes into the harness stdout": (
        "    return 0\nimport os\n"
        "f = open('/proc/%d/fd/1' % os.getppid(), 'w')\n"
        "f.write('\\n' + '0' * 32 + ' {}\\n')\n"),
    "kills the harness": (
        "    import os, signal\n    os.kill(os.getppid(), signal.SIGKILL)\n"),
    "hangs": "    while True:\n        pass\n",
}


def test_function_correct_completion_passes(reward):
  res = reward(FUNC_RECORD, GOOD_COMPLETION)
  assert res.correct and res.score == 1.0, res.info
  # A fenced full function is accepted too (it redefines the stub).
  fenced = "```python\ndef add(a, b):\n    return b + a\n```"
  assert reward(FUNC_RECORD, fenced).correct


@pytest.mark.slow
def test_function_tampering_fails(reward):
  names = sorted(TAMPERING)
  results = reward.batch([FUNC_RECORD] * len(names),
                         [TAMPERING[n] for n in names])
  passed = [n for n, r in zip(names, results) if r.correct]
  assert not passed
  assert all(r.score == 0.0 for r in results)


def test_works_through_http_client_and_threads(sandbox):
  srv = make_server(ServerConfig(host="127.0.0.1", port=0,
                                 max_concurrency=2), sandbox)
  thread = threading.Thread(target=srv.serve_forever, daemon=True)
  thread.start()
  try:
    reward = CodeReward(SandboxClient(srv.url))
    records = [FUNC_RECORD, FUNC_RECORD,
               {"id": "s", "prompt": "", "tests": SUM_TESTS}]
    results = score_all(reward, records,
                        [GOOD_COMPLETION, "    return a - b\n",
                         CORRECT["python"]])
    assert [r.correct for r in results] == [True, False, True]
  finally:
    srv.shutdown()
    srv.server_close()


def test_stderr_noise_is_ignored_but_stdout_is_capped(sandbox):
  reward = CodeReward(sandbox, max_output_bytes=1000)
  tests = [{"input": "1 2\n", "output": "3\n"}]
  noisy = ("import sys\nsys.stderr.write('debug ' * 20000)\n"
           "a, b = map(int, input().split())\nprint(a + b)\n")
  flood = "print('3' + ' ' * 5000)\n"  # right answer, but 5 KB of output
  results = reward.batch([{"id": "n", "prompt": "", "tests": tests}] * 2,
                         [noisy, flood])
  assert results[0].correct, results[0].info
  assert not results[1].correct
  assert results[1].info["status"] == "output_limit"
