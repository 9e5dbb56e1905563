"""Functional tests of the sandbox (real bubblewrap) and its HTTP service."""

from __future__ import annotations

import dataclasses
import http.client
import json
import os
import socket
import subprocess
import sys
import threading
import time

import pytest

from kimi_jax.sandbox import (ExecRequest, ExecResult, RequestCaps, Sandbox,
                              SandboxClient, SandboxLimits,
                              SandboxRequestError, SandboxUnavailableError)
from kimi_jax.sandbox import isolation
from kimi_jax.sandbox.runner import RawOutcome
from kimi_jax.sandbox.sandbox import classify
from kimi_jax.sandbox.server import ServerConfig, make_server

LIMITS = SandboxLimits(cpu_time_s=2, wall_time_s=5, memory_mb=256)
CAPS = RequestCaps(max_source_bytes=1000, max_stdin_bytes=1000, max_files=2,
                   max_files_bytes=1000)


def _make_sandbox(**kw) -> Sandbox:
  try:
    return Sandbox(**kw)
  except SandboxUnavailableError as e:
    pytest.fail(f"sandbox unavailable: {e}. Run .ci/install_system_deps.sh")


@pytest.fixture(scope="module")
def sb():
  box = _make_sandbox(limits=LIMITS, max_workers=2, caps=CAPS)
  yield box
  box.close()


HELLO = {
    "python": "import sys\nprint('hello', sys.stdin.read().strip())",
    "javascript": "const s = require('fs').readFileSync(0, 'utf8').trim();\n"
                  "console.log('hello', s);",
    "cpp": "#include <iostream>\n#include <string>\nint main(){std::string s;"
           "std::cin >> s; std::cout << \"hello \" << s << std::endl;}",
}


@pytest.mark.parametrize("language", sorted(HELLO))
def test_hello_world_with_stdin(sb, language):
  res = sb.run(ExecRequest(language, HELLO[language], stdin="world\n"))
  assert res == ExecResult("ok", 0, "hello world\n", "", res.wall_s, False)
  assert 0 < res.wall_s < 5


def test_no_stdin_reads_eof(sb):
  res = sb.run(ExecRequest("python", "import sys; print(repr(sys.stdin.read()))"))
  assert res.stdout == "''\n"


@pytest.mark.parametrize("language,source,code", [
    ("python", "import sys; sys.exit(7)", 7),
    ("javascript", "process.exit(3)", 3),
    ("cpp", "int main(){return 5;}", 5),
])
def test_exit_codes(sb, language, source, code):
  res = sb.run(ExecRequest(language, source))
  assert res.status == "runtime_error" and res.exit_code == code, res


def test_python_runtime_error_has_traceback(sb):
  res = sb.run(ExecRequest("python", "print('before')\n1/0"))
  assert res.status == "runtime_error" and res.exit_code == 1
  assert res.stdout == "before\n" and "ZeroDivisionError" in res.stderr


def test_javascript_memory_limit(sb):
  res = sb.run(ExecRequest("javascript", "const a = [];\n"
                           "while (true) a.push(Buffer.alloc(1e7, 1));"))
  assert res.status == "memory_limit", res


def test_javascript_exception(sb):
  res = sb.run(ExecRequest("javascript", "throw new Error('boom')"))
  assert res.status == "runtime_error" and "boom" in res.stderr


def test_cpp_segfault_is_signal(sb):
  res = sb.run(ExecRequest("cpp", "int main(){volatile int *p = 0; return *p;}"))
  assert res.status == "runtime_error" and res.exit_code == -11, res


def test_cpp_compile_error(sb):
  res = sb.run(ExecRequest("cpp", "int main(){ return undefined_name; }"))
  assert res.status == "compile_error", res
  assert "undefined_name" in res.stderr and res.stdout == ""


def test_files_are_written_and_importable(sb):
  res = sb.run(ExecRequest(
      "python", "import helper\nprint(helper.f(), open('data.txt').read())",
      files={"helper.py": "def f():\n  return 41 + 1\n", "data.txt": "abc"}))
  assert res.status == "ok" and res.stdout == "42 abc\n", res


def test_workdir_is_private_per_run(sb):
  assert sb.run(ExecRequest("python", "open('left.txt', 'w').write('x')")).ok
  res = sb.run(ExecRequest("python", "import os; print(sorted(os.listdir('.')))"))
  assert res.stdout == "['main.py']\n"


def test_run_batch_preserves_order(sb):
  reqs = [ExecRequest("python", f"import time; time.sleep({0.3 - i * 0.1}); "
                      f"print({i})") for i in range(3)]
  reqs.append(ExecRequest("javascript", "console.log(3)"))
  out = sb.run_batch(reqs)
  assert [r.stdout for r in out] == ["0\n", "1\n", "2\n", "3\n"]


def test_per_request_limits(sb):
  tight = dataclasses.replace(LIMITS, wall_time_s=0.5)
  res = sb.run(ExecRequest("python", "import time; time.sleep(3)", limits=tight))
  assert res.status == "timeout" and res.wall_s < 2


@pytest.mark.parametrize("req,field", [
    (ExecRequest("ruby", "puts 1"), "language"),
    (ExecRequest("python", "x" * 1001), "source"),
    (ExecRequest("python", "", stdin="x" * 1001), "stdin"),
    (ExecRequest("python", "", files={"a": "1", "b": "2", "c": "3"}), "files"),
    (ExecRequest("python", "", files={"a": "x" * 1001}), "files"),
    (ExecRequest("python", "", files={"../x": "1"}), "files['../x']"),
    (ExecRequest("python", "", files={"main.py": "1"}), "files['main.py']"),
    (ExecRequest("python", 5), "source"),  # type: ignore[arg-type]
    (ExecRequest("python", "", limits=dataclasses.replace(LIMITS, cpu_time_s=-1)),
     "limits.cpu_time_s"),
    (ExecRequest("python", "", limits=dataclasses.replace(LIMITS, memory_mb=1.5)),
     "limits.memory_mb"),
    (ExecRequest("python", "", limits=dataclasses.replace(LIMITS, wall_time_s=1e9)),
     "limits.wall_time_s"),
    (ExecRequest("python", "", limits=dataclasses.replace(
        LIMITS, max_processes=True)), "limits.max_processes"),
])
def test_request_validation(sb, req, field):
  with pytest.raises(SandboxRequestError) as info:
    sb.run(req)
  assert isinstance(info.value, ValueError)
  assert info.value.field == field and field in str(info.value)


def test_batch_validation_names_index(sb):
  with pytest.raises(SandboxRequestError) as info:
    sb.run_batch([ExecRequest("python", "print(1)"), ExecRequest("go", "")])
  assert info.value.field == "requests[1].language"


def test_missing_bwrap_is_a_clear_error(monkeypatch):
  from kimi_jax.sandbox import isolation
  real = isolation._which
  monkeypatch.setattr(isolation, "_which", lambda name, *a: None if name == "bwrap"
                      else real(name, *a))
  with pytest.raises(SandboxUnavailableError, match="install_system_deps.sh"):
    Sandbox()


def test_invalid_sandbox_limits_rejected():
  with pytest.raises(SandboxRequestError, match="limits.tmpfs_size_mb"):
    Sandbox(limits=SandboxLimits(tmpfs_size_mb=0))


def test_classify_is_pure():
  def raw(**kw):
    base = dict(returncode=0, stdout=b"", stderr=b"", status=b"\x01",
                killed=None, truncated=False, wall_s=0.1, cpu_s=0.0)
    return RawOutcome(**{**base, **kw})
  assert classify(raw(), "python", LIMITS).status == "ok"
  assert classify(raw(status=b""), "python", LIMITS).status == "sandbox_error"
  assert classify(raw(returncode=128 + 24), "python", LIMITS).status == "timeout"
  assert classify(raw(returncode=1, stderr=b"x\nMemoryError\n"), "python",
                  LIMITS).status == "memory_limit"
  assert classify(raw(returncode=1, status=b"\x01err"), "cpp",
                  LIMITS).status == "compile_error"
  # Killed by the memory watchdog; a CPU-rlimit SIGKILL (caught SIGXCPU) or
  # a parent exiting after its child's CPU kill: timeouts.
  assert classify(raw(returncode=None, killed="memory_limit"), "javascript",
                  LIMITS).status == "memory_limit"
  assert classify(raw(returncode=128 + 9, cpu_limit_hit=True), "python",
                  LIMITS).status == "timeout"
  assert classify(raw(returncode=1, cpu_limit_hit=True), "python",
                  LIMITS).status == "timeout"
  assert classify(raw(returncode=128 + 9), "python",
                  LIMITS).status == "runtime_error"
  # A parent exiting 1 after its child's CPU kill that the watchdog missed:
  # the tree's CPU time (2.05 s against the 2 s limit) tells; below the limit,
  # or in C++ (its tree time includes the compile), it does not.
  assert classify(raw(returncode=1, cpu_s=2.05), "python",
                  LIMITS).status == "timeout"
  assert classify(raw(returncode=1, cpu_s=2.05), "javascript",
                  LIMITS).status == "timeout"
  assert classify(raw(returncode=1, cpu_s=1.9), "python",
                  LIMITS).status == "runtime_error"
  compiled = isolation.STARTED_MARK + isolation.COMPILED_MARK
  assert classify(raw(returncode=1, cpu_s=2.05, status=compiled), "cpp",
                  LIMITS).status == "runtime_error"
  assert classify(raw(returncode=0, cpu_s=2.05), "python", LIMITS).status == "ok"


# -- command line ---------------------------------------------------------------

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("script", ["sandbox_server.py", "sandbox_run.py"])
def test_every_limit_is_a_flag(script):
  out = subprocess.run([sys.executable, os.path.join(ROOT, "launch", script),
                        "--help"], capture_output=True, text=True,
                       env={**os.environ, "PYTHONPATH": ROOT})
  assert out.returncode == 0, out.stderr
  for f in dataclasses.fields(SandboxLimits):
    assert "--" + f.name.replace("_", "-") + " " in out.stdout, f.name


def test_flags_build_the_limits():
  import argparse
  from kimi_jax.sandbox.flags import add_limit_flags, limits_from_args
  p = argparse.ArgumentParser()
  add_limit_flags(p)
  limits = limits_from_args(p.parse_args(["--memory-mb", "300",
                                          "--compile-wall-time-s", "7.5"]))
  assert limits == dataclasses.replace(SandboxLimits(), memory_mb=300,
                                       compile_wall_time_s=7.5)


def test_sandbox_run_cli(tmp_path):
  prog = tmp_path / "echo.py"
  prog.write_text("import sys\nprint('got', sys.stdin.read().strip())\n")
  stdin = tmp_path / "in.txt"
  stdin.write_text("hello\n")
  cmd = [sys.executable, os.path.join(ROOT, "launch", "sandbox_run.py"),
         str(prog), "--stdin", str(stdin), "--json", "--memory-mb", "128"]
  out = subprocess.run(cmd, capture_output=True, text=True,
                       env={**os.environ, "PYTHONPATH": ROOT})
  assert out.returncode == 0, out.stderr
  result = json.loads(out.stdout)
  assert (result["status"], result["stdout"]) == ("ok", "got hello\n")
  bomb = tmp_path / "bomb.js"
  bomb.write_text("const a = []; while (true) a.push(Buffer.alloc(1 << 24, 1));")
  out = subprocess.run(cmd[:2] + [str(bomb), "--memory-mb", "128"],
                       capture_output=True, text=True,
                       env={**os.environ, "PYTHONPATH": ROOT})
  assert out.returncode == 1 and out.stdout.startswith(
      "status: memory_limit"), out.stdout
  out = subprocess.run(cmd[:2] + [str(tmp_path / "x.rs")], capture_output=True,
                       text=True, env={**os.environ, "PYTHONPATH": ROOT})
  assert out.returncode == 2 and "--lang" in out.stderr


# -- HTTP service -------------------------------------------------------------

@pytest.fixture(scope="module")
def server():
  box = _make_sandbox(limits=LIMITS, max_workers=2)
  srv = make_server(ServerConfig(host="127.0.0.1", port=0, max_concurrency=1,
                                 max_request_bytes=4096, queue_timeout_s=0.5),
                    box)
  thread = threading.Thread(target=srv.serve_forever, daemon=True)
  thread.start()
  yield srv
  srv.shutdown()
  srv.server_close()
  box.close()


def _post(srv, path: str, body: bytes) -> tuple[int, dict]:
  conn = http.client.HTTPConnection(*srv.server_address[:2], timeout=30)
  conn.request("POST", path, body=body,
               headers={"Content-Type": "application/json"})
  resp = conn.getresponse()
  payload = json.loads(resp.read())
  conn.close()
  return resp.status, payload


def test_http_health_run_and_batch(server):
  client = SandboxClient(server.url)
  health = client.health()
  assert health["status"] == "ok" and "python" in health["languages"]
  res = client.run(ExecRequest("python", "print(input()[::-1])", stdin="abc"))
  assert res == ExecResult("ok", 0, "cba\n", "", res.wall_s, False)
  out = client.run_batch([ExecRequest("python", "print(1)"),
                          ExecRequest("javascript", "console.log(2)")])
  assert [r.stdout for r in out] == ["1\n", "2\n"]


def test_http_client_raises_request_error(server):
  with pytest.raises(SandboxRequestError) as info:
    SandboxClient(server.url).run(ExecRequest("cobol", ""))
  assert info.value.field == "language"


@pytest.mark.parametrize("path,body,field", [
    ("/run", b"{not json", "body"),
    ("/run", b'{"language": "python"}', "source"),
    ("/run", b'{"language": "python", "source": 1}', "source"),
    ("/run", b'{"language": "python", "source": "", "bogus": 1}', "bogus"),
    ("/run", b'{"language": "python", "source": "", "limits": {"memory_mb": -5}}',
     "limits.memory_mb"),
    ("/run", b'[1, 2]', "request"),
    ("/run_batch", b'{"language": "python"}', "requests"),
    ("/run_batch", b'[{"language": "python", "source": ""}, {"source": ""}]',
     "requests[1].language"),
])
def test_http_400_names_field(server, path, body, field):
  status, payload = _post(server, path, body)
  assert status == 400, payload
  assert payload["field"] == field and field in payload["message"]


def test_http_413_and_404(server):
  status, payload = _post(server, "/run", b"x" * 5000)
  assert status == 413 and payload["error"] == "too_large"
  status, payload = _post(server, "/nope", b"{}")
  assert status == 404


def test_http_server_survives_garbage(server):
  for junk in (b"\x00\xff garbage\r\n\r\n", b"POST /run HTTP/1.1\r\n"
               b"Content-Length: 99999999999999999999999\r\n\r\n"):
    with socket.create_connection(server.server_address[:2], timeout=5) as s:
      s.sendall(junk)
      s.recv(1000)
  assert SandboxClient(server.url).health()["status"] == "ok"


@pytest.mark.slow  # an HTTP server and sandboxed runs
def test_http_concurrency_limit_gives_503(server):
  # max_concurrency=1 and a 0.5 s queue timeout: a second request arriving
  # while a 2 s program runs waits, then gets 503.
  body = json.dumps({"language": "python",
                     "source": "import time; time.sleep(2)"}).encode()
  results = []
  threads = [threading.Thread(target=lambda: results.append(
      _post(server, "/run", body)[0])) for _ in range(2)]
  threads[0].start()
  time.sleep(0.3)
  threads[1].start()
  for t in threads:
    t.join()
  assert sorted(results) == [200, 503]
