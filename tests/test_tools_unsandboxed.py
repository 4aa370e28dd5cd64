"""Without a sandbox, the agent's tools load no candidate code that the gate's audit of what was
built would refuse (issue 27): a kernel that writes a file outside the task through fopen is never
run by check, bench, sweep or profile, and nothing is written. An honest kernel is not refused.

The host's sandbox is switched off (`KLOOP_SANDBOX=off`), so this holds on machines with bubblewrap
(CI) as on those without."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tests.fake_anthropic import fake_api  # noqa: F401 (the loopback Messages API fixture)
from tests.fakes import fake_port
from tools import sandbox
from tools.agent_tools import session_toolbox
from tools.task import load_task

ROOT = Path(__file__).resolve().parents[1]
ENTRY = 'extern "C" int kloop_matmul(const float* A, const float* B, float* C, int M, int N, int K) {\n'


@pytest.fixture()
def unsandboxed(tmp_path, monkeypatch):
    monkeypatch.setenv("KLOOP_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv(sandbox.DISABLE_VAR, "off")
    sandbox.status.cache_clear()
    yield
    sandbox.status.cache_clear()


def task_writing(tmp_path: Path, target: Path):
    """matmul_cpu whose entry point first writes `target` (outside the task) through fopen."""
    folder = tmp_path / "matmul_cpu"
    shutil.copytree(ROOT / "kernels" / "matmul_cpu", folder)
    src = folder / "matmul.cpp"
    text = src.read_text()
    assert ENTRY in text
    planted = f'  if (FILE* f = fopen("{target}", "w")) {{ fputs("pwned", f); fclose(f); }}\n'
    src.write_text("#include <cstdio>\n" + text.replace(ENTRY, ENTRY + planted))
    return load_task(folder)


def test_tools_that_load_code_refuse_what_the_audit_refuses(tmp_path, unsandboxed):
    target = tmp_path / "outside" / "pwned.txt"
    target.parent.mkdir()
    task = task_writing(tmp_path, target)
    box = session_toolbox(fake_port(task, tmp_path / "notes.md"))
    built = box.call("build", {})
    assert not built.ok and "audit: REJECTED" in built.text and "fopen" in built.text
    for name, args in [("check", {}), ("bench", {"seconds": 0.05})]:
        res = box.call(name, args)
        assert not res.ok, name
        assert "no sandbox" in res.text and "fopen" in res.text, (name, res.text)
    (row,) = box.call("sweep", {"configs": [{}], "seconds": 0.05}).data["rows"]  # a ranking: the setting failed
    assert not row["ok"] and "no sandbox" in row["error"] and "fopen" in row["error"]
    assert not target.exists()  # never loaded, so never run


def test_an_honest_kernel_is_not_refused_without_a_sandbox(tmp_path, unsandboxed):
    from tools.build import build
    from tools.evaluate import unsandboxed_refusal

    folder = tmp_path / "matmul_cpu"
    shutil.copytree(ROOT / "kernels" / "matmul_cpu", folder)
    task = load_task(folder)
    built = build(task)
    assert built.ok and unsandboxed_refusal(task, built) is None  # the audit passes: the tools load it


def test_claude_check_of_a_refused_build_is_answered_not_run(tmp_path, unsandboxed, fake_api):
    """Through the real SDK against the loopback API: the model calls check on a kernel that writes
    outside the task; without a sandbox the call is answered with the audit's refusal and nothing
    of the candidate runs."""
    from agent.llm import LLMClient
    from agent.policies.claude import ClaudePolicy
    from tests.fake_anthropic import Reply, tool_use
    from tests.test_claude_policy import KEY, MODEL, FakeCtx, done, last_user

    target = tmp_path / "outside" / "pwned.txt"
    target.parent.mkdir()
    ctx = FakeCtx(session_toolbox(fake_port(task_writing(tmp_path, target), tmp_path / "notes.md")))
    fake_api.add(Reply([tool_use("check", {}), tool_use("bench", {"seconds": 0.05})], stop_reason="tool_use"), *done())
    client = LLMClient(MODEL, api_key=KEY, base_url=fake_api.base_url, backoff_base=0.01)
    assert ClaudePolicy(model=MODEL, max_tokens=4096, client=client).run(ctx) == "end_turn"
    results = last_user(fake_api.requests[1].body)
    assert [r.get("is_error") for r in results] == [True, True]
    assert all("no sandbox" in r["content"] and "fopen" in r["content"] for r in results)
    assert not target.exists()
