"""The CUDA runtime cheats (tests/cheats/cu_*.cu, on the softmax task) on a machine without a GPU:
each compiles with the task's flags through the gate's own build, and gets past every layer that
looks at code (the gate's static rules on the sources, and the audit of what was built: symbols,
syscalls, load-time code, headers, preprocessed text). So only the runtime layers can stop them;
tests/gpu/test_cheats_cuda.py shows on the H200 that each fools a naive harness and not the gate.
The CUDA build-time kinds (bt_*.cu: graphs, host functions, streams, persisting-L2 windows, memcpy
caches) are in tests/test_cheats_build.py: the audit rejects those.
"""

from __future__ import annotations

import shutil
import time

import pytest

from agent.gate import Gate
from tests.cuda_cheats import CU_CHEATS, TASK, build_all, candidates, kind_of
from tools.build import compiler_version


def test_corpus_is_complete():
    assert len(CU_CHEATS) >= 10
    assert {kind_of(p) for p in CU_CHEATS} == {"runtime"}


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    if compiler_version("cuda") == "missing":
        pytest.skip("no nvcc here")
    trusted = tmp_path_factory.mktemp("trusted") / "softmax"
    shutil.copytree(TASK, trusted)
    gate = Gate(trusted, "kernels/softmax")
    cands = candidates(gate, tmp_path_factory.mktemp("cands"), CU_CHEATS)
    started = time.monotonic()
    results = build_all(gate, cands)
    print(f"\n{len(results)} CUDA cheats built in {time.monotonic() - started:.1f} s "
          f"({sum(r.cached for r in results.values())} from the cache)")
    return gate, cands, results


@pytest.mark.parametrize("cheat", [p.stem for p in CU_CHEATS])
def test_runtime_cheat_gets_past_static_rules_and_audit(built, cheat):
    gate, cands, results = built
    assert gate.out_of_scope(cands[cheat]) == []
    assert gate.static_hits(cands[cheat]) == [], "a runtime kind must reach the runtime layers"
    res = results[cheat]
    assert res.ok, res.error_text()
    report = gate.audit(res)
    assert report.ok, report.reason()
    assert any("softmax" in k.name or "rows" in k.name for k in res.kernels), [k.name for k in res.kernels]


def test_judge_flush_resets_persisting_lines_before_the_write(monkeypatch):
    """The L2 flush before a CUDA timed or probed call is the judge's (tools.timing.Timer, in the judge's
    own context, so a runner has none to skip): persisting lines demoted first, then the write that evicts
    them (the other order leaves lines kept through the write in L2, and the next call reads them there)."""
    import torch

    from tools import libhost, timing

    order = []

    class Buf:
        def zero_(self):
            order.append("write")

    monkeypatch.setattr(timing, "_reset_persisting_l2", lambda: order.append("reset"))
    timing.flush_l2(Buf())
    assert order == ["reset", "write"]
    timer = timing.Timer.__new__(timing.Timer)
    timer.device, timer.cuda, timer._flush = torch.device("cuda"), True, Buf()
    order.clear()
    timer.flush()
    assert order == ["reset", "write"]
    # the runner has no flush of its own left to skip
    assert not hasattr(libhost.Host, "flush") and "flush" not in libhost.Host.run.__code__.co_varnames
