"""The sandbox (tools/sandbox.py) holds: from inside, no network, no other process, no file outside
the scratch folder written, no secret read, no exec after lockdown; the runner that checks a kernel
uses it; secrets are scrubbed from tool results; --require-sandbox refuses where there is none."""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
import textwrap
import urllib.parse
from pathlib import Path

import pytest

from tools import sandbox
from tools.base import Tool, ToolBox, ToolInput, ToolResult
from tools.secrets import REDACTED, scrub

ROOT = Path(__file__).resolve().parents[1]
KEY = "sk-ant-kloop-test-" + "0123456789abcdef" * 3

needs_sandbox = pytest.mark.skipif(not sandbox.status().available,
                                   reason=f"no sandbox on this host: {sandbox.status().reason}")


def run_sandboxed(tmp_path: Path, code: str) -> dict:
    """Run Python `code` in the runner's sandbox (tools/ readable, tmp_path/scratch writable); it
    prints one JSON object."""
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    env = sandbox.minimal_env({"PYTHONPATH": str(ROOT)}, home=scratch)
    argv = sandbox.sandboxed_argv([sys.executable, "-c", textwrap.dedent(code)], readable=[ROOT / "tools"],
                                  writable=[scratch], cwd=scratch, env=env)
    p = subprocess.run(argv, capture_output=True, text=True, timeout=120, env=env)
    assert p.returncode == 0, p.stderr[-2000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


@needs_sandbox
def test_inside_the_sandbox(tmp_path):
    (tmp_path / "outside.txt").write_text("host file")
    got = run_sandboxed(tmp_path, f"""
        import json, os, socket, threading
        out = {{}}
        try:
            socket.create_connection(("1.1.1.1", 53), timeout=3); out["net"] = "connected"
        except OSError as e:
            out["net"] = type(e).__name__
        out["pids"] = sorted(int(p) for p in os.listdir("/proc") if p.isdigit())
        def readable(path):
            try:
                open(path, "rb").read(1); return True
            except OSError:
                return False
        out["ssh"] = readable(os.path.expanduser("~root/.ssh/id_rsa")) or os.path.exists("/root/.ssh")
        out["passwd"] = readable("/etc/passwd")
        out["host_file"] = readable({str(tmp_path / 'outside.txt')!r})
        out["ppid_environ"] = open(f"/proc/{{os.getppid()}}/environ", "rb").read().decode(errors="replace")
        def writable(path):
            try:
                open(path, "w").write("x"); return True
            except OSError:
                return False
        out["write_tools"] = writable({str(ROOT / 'tools' / 'kloop-sandbox-probe')!r})
        out["write_root"] = writable("/kloop-probe")
        out["write_scratch"] = writable(os.path.join(os.environ["HOME"], "ok"))
        out["env"] = sorted(os.environ)
        from tools.sandbox import lockdown
        lockdown()
        for name, fn in [("exec", lambda: os.execv("/bin/sh", ["sh", "-c", "true"])), ("fork", os.fork),
                         ("socket", lambda: socket.socket(socket.AF_UNIX)),
                         ("subprocess", lambda: __import__("subprocess").run(["/bin/true"]))]:
            try:
                fn(); out[name] = "allowed"
            except OSError as e:
                out[name] = e.errno
        box = []
        t = threading.Thread(target=lambda: box.append(sum(range(1000)))); t.start(); t.join()
        out["thread"] = box == [499500]
        print(json.dumps(out))
    """)
    assert got["net"] != "connected"
    assert os.getpid() not in got["pids"] and len(got["pids"]) <= 3, got["pids"]  # bwrap's init and us
    assert not got["ssh"] and not got["passwd"] and not got["host_file"]
    assert KEY not in got["ppid_environ"] and "ANTHROPIC" not in got["ppid_environ"]
    assert not got["write_tools"] and not got["write_root"] and got["write_scratch"]
    assert not (ROOT / "tools" / "kloop-sandbox-probe").exists()
    assert set(got["env"]) <= {"PATH", "HOME", "TMPDIR", "LANG", "LC_ALL", "USER", "LOGNAME", "PYTHONPATH", "PWD", *sandbox.INHERITED}
    assert got["exec"] == got["fork"] == got["socket"] == got["subprocess"] == 1  # EPERM
    assert got["thread"]


_LEAKY_KERNEL = r"""
// Reads every environment it can see (its own, its parent's, all of /proc) for the API key; where it
// finds it, it poisons its output so that the check fails.
#include <cstdio>
#include <cstring>
#include <cstdlib>
#include <cmath>
#include <dirent.h>
#include <unistd.h>
static bool found_in(const char* path) {
  FILE* f = fopen(path, "rb");
  if (!f) return false;
  static char buf[1 << 16];
  size_t n = fread(buf, 1, sizeof buf, f);
  fclose(f);
  const char* key = "sk-ant-kloop-test";
  for (size_t i = 0; i + 17 <= n; ++i)
    if (!memcmp(buf + i, key, 17)) return true;
  return false;
}
extern "C" int kloop_matmul(const float* A, const float* B, float* C, int M, int N, int K) {
  bool leak = getenv("ANTHROPIC_API_KEY") != nullptr;
  char path[64];
  snprintf(path, sizeof path, "/proc/%d/environ", (int)getppid());
  leak |= found_in(path) || found_in("/proc/self/environ");
  if (DIR* d = opendir("/proc")) {
    while (dirent* e = readdir(d)) {
      if (e->d_name[0] < '0' || e->d_name[0] > '9') continue;
      snprintf(path, sizeof path, "/proc/%s/environ", e->d_name);
      leak |= found_in(path);
    }
    closedir(d);
  }
  for (int i = 0; i < M; ++i)
    for (int j = 0; j < N; ++j) {
      float acc = 0.f;
      for (int k = 0; k < K; ++k) acc += A[(size_t)i * K + k] * B[(size_t)k * N + j];
      C[(size_t)i * N + j] = leak ? NAN : acc;
    }
  return 0;
}
"""

_CHECK_SCRIPT = """
import json, shutil, sys
from pathlib import Path
from tools.task import load_task
from tools.build import build
from tools.evaluate import run_check
folder = Path(sys.argv[1])
task = load_task(folder)
res = run_check(task, build(task, cache_dir=folder.parent / "cache").lib, seed=3, shapes=["one", "odd"])
print(json.dumps({"ok": res.ok, "passed": bool(res.check and res.check.passed), "error": res.error}))
"""


def _check_with_key_in_parent(tmp_path: Path, sandbox_off: bool) -> dict:
    import shutil

    folder = tmp_path / "task"
    shutil.copytree(ROOT / "kernels" / "matmul_cpu", folder)
    (folder / "matmul.cpp").write_text(_LEAKY_KERNEL)
    env = dict(os.environ, ANTHROPIC_API_KEY=KEY, PYTHONPATH=str(ROOT))  # in the session's initial environment
    if sandbox_off:
        env["KLOOP_SANDBOX"] = "off"
    p = subprocess.run([sys.executable, "-c", _CHECK_SCRIPT, str(folder)], capture_output=True, text=True,
                       timeout=600, env=env, cwd=tmp_path)
    assert p.returncode == 0, p.stderr[-2000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


@needs_sandbox
def test_kernel_reading_the_environment_during_check_gets_nothing(tmp_path):
    got = _check_with_key_in_parent(tmp_path, sandbox_off=False)
    assert got["ok"] and got["passed"], got


_NAIVE_HOST = """
import ctypes, math, os, subprocess, sys
if sys.argv[1] == "parent":  # holds the key, like a session; its child gets a cleaned environment
    env = {k: v for k, v in os.environ.items() if k != "ANTHROPIC_API_KEY"}
    sys.exit(subprocess.run([sys.executable, sys.argv[2], "child", sys.argv[2], sys.argv[3]], env=env).returncode)
lib = ctypes.CDLL(sys.argv[3])
a, b, c = (ctypes.c_float * 1)(1.0), (ctypes.c_float * 1)(1.0), (ctypes.c_float * 1)(0.0)
lib.kloop_matmul(a, b, c, 1, 1, 1)
print("found" if math.isnan(c[0]) else "not found")
"""


def test_the_kernel_finds_the_key_where_only_the_environment_is_cleaned(tmp_path):
    """The control: in a plain process whose environment was cleaned but whose parent holds the key
    (in its /proc/<pid>/environ), the kernel above finds it, so the tests around can fail."""
    if not Path("/proc/self/environ").exists():
        pytest.skip("no /proc here")
    import shutil

    from tools.build import build
    from tools.task import load_task

    folder = tmp_path / "task"
    shutil.copytree(ROOT / "kernels" / "matmul_cpu", folder)
    (folder / "matmul.cpp").write_text(_LEAKY_KERNEL)
    built = build(load_task(folder), cache_dir=tmp_path / "cache")
    assert built.ok, built.error_text()
    script = tmp_path / "host.py"
    script.write_text(_NAIVE_HOST)
    p = subprocess.run([sys.executable, str(script), "parent", str(script), built.lib], capture_output=True, text=True,
                       timeout=120, env=dict(os.environ, ANTHROPIC_API_KEY=KEY))
    assert p.returncode == 0, p.stderr[-2000:]
    assert p.stdout.strip().splitlines()[-1] == "found", p.stdout


def test_without_the_sandbox_hardened_processes_still_keep_the_key(tmp_path):
    """With the sandbox off (other processes visible in /proc), the session and the judge are not
    dumpable and the runner has no capabilities: the same kernel finds nothing."""
    if not Path("/proc/self/environ").exists():
        pytest.skip("no /proc here")
    got = _check_with_key_in_parent(tmp_path, sandbox_off=True)
    assert got["ok"] and got["passed"], got


def test_tool_results_reach_the_model_redacted(monkeypatch):
    monkeypatch.setenv("ANTHROPIC_API_KEY", KEY)
    forms = {
        "plain": KEY,
        "base64": base64.b64encode(KEY.encode()).decode(),
        "base64 inside": base64.b64encode(b"x=" + KEY.encode() + b";").decode(),
        "hex": KEY.encode().hex(),
        "HEX": KEY.encode().hex().upper(),
        "reversed": KEY[::-1],
        "url": "k%3D" + urllib.parse.quote(KEY, safe=""),
        "url, every byte": "k=" + "".join(f"%{b:02X}" for b in KEY.encode()),
    }

    class Empty(ToolInput):
        pass

    def leak(ctx, args):
        return ToolResult(text="\n".join(f"{k}: {v}" for k, v in forms.items()), data={"env": forms})

    def boom(ctx, args):
        raise RuntimeError(f"failed reading {KEY}")

    box = ToolBox(context=None)
    box.add(Tool("leak", "", Empty, leak))
    box.add(Tool("boom", "", Empty, boom))
    res = box.call("leak", {})
    err = box.call("boom", {})
    core = KEY[8:-8]
    for text in (res.text, json.dumps(res.data), err.text):
        assert core not in text and core[::-1] not in text
        assert core.encode().hex() not in text.lower()
        assert base64.b64encode(KEY.encode()).decode()[4:-4] not in text
    assert res.text.count(REDACTED) >= len(forms)


def test_scrub_leaves_ordinary_text_alone():
    assert scrub("speedup x1.23, 4 pairs", [KEY]) == "speedup x1.23, 4 pairs"
    assert scrub(f"key={KEY}!", [KEY]) == f"key={REDACTED}!"
    assert scrub("short", ["1234"]) == "short"  # too short to be a secret


def test_minimal_env_is_an_allow_list():
    env = sandbox.minimal_env(base={"ANTHROPIC_API_KEY": KEY, "GITHUB_TOKEN": "t" * 20, "SOME_SETTING": "x",
                                    "CUDA_VISIBLE_DEVICES": "1", "PATH": "/evil"})
    assert env["CUDA_VISIBLE_DEVICES"] == "1"
    assert not {"ANTHROPIC_API_KEY", "GITHUB_TOKEN", "SOME_SETTING"} & set(env)
    assert "/evil" not in env["PATH"]


def test_require_sandbox_refuses_when_unavailable(tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from agent.cli import app

    monkeypatch.setenv("KLOOP_SANDBOX", "off")
    sandbox.status.cache_clear()
    try:
        assert not sandbox.status().available and "KLOOP_SANDBOX" in sandbox.status().reason
        with pytest.raises(sandbox.SandboxUnavailable):
            sandbox.require()
        result = CliRunner().invoke(app, ["optimize", str(ROOT / "kernels" / "matmul_cpu"), "--agent", "tuner",
                                          "--max-attempts", "1", "--runs-dir", str(tmp_path / "runs"),
                                          "--require-sandbox"])
    finally:
        sandbox.status.cache_clear()
    assert result.exit_code != 0
    assert "sandbox is not available" in result.output
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").iterdir())


def test_runner_pid_namespaces_are_probed_and_said():
    """status() says whether each runner gets a PID namespace of its own (run.json records it), and
    why not where it cannot; the line printed at session start says so loudly."""
    s = sandbox.status()
    assert "runner_pidns" in s.as_dict() and "runner_pidns_reason" in s.as_dict()
    if s.runner_pidns:
        assert "runner PID namespaces" in s.mechanism and not s.runner_pidns_reason
    else:
        assert s.runner_pidns_reason and "runner PID namespaces UNAVAILABLE" in s.line()


def test_a_runner_in_its_own_pid_namespace_sees_only_itself_and_its_init(tmp_path, monkeypatch):
    """Started by a judge (KLOOP_RUNNER_PIDNS=1), a runner lives in its own PID namespace under a
    small init (PID 1 ignores self-sent default signals, so an abort() in the runner itself would
    read as something else); the judge still reads its CPU clock and stops it, through its pid in
    the judge's namespace."""
    from tools.runner import Runner

    if not sandbox.status().runner_pidns:
        pytest.skip(f"no runner PID namespaces here: {sandbox.status().runner_pidns_reason}")
    monkeypatch.setenv(sandbox.RUNNER_PIDNS_VAR, "1")
    runner = Runner(tmp_path, "ns")
    try:
        assert runner.pid != runner.proc.pid  # the Popen is the unshare wrapper
        nspid = Path(f"/proc/{runner.pid}/status").read_text().split("NSpid:")[1].split("\n")[0].split()
        assert nspid == [str(runner.pid), str(sandbox.PIDNS_DEPTH)], nspid
        init_pid = int(Path(f"/proc/{runner.pid}/status").read_text().split("PPid:")[1].split()[0])
        init_nspid = Path(f"/proc/{init_pid}/status").read_text().split("NSpid:")[1].split("\n")[0].split()
        assert init_nspid[-1] == "1", init_nspid
        runner.request("unbind", 60, keys=[])  # it serves
        assert runner.cpu_ns() > 0
    finally:
        runner.close()
    assert runner.proc.poll() is not None
