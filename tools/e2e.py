"""The end-to-end check: a short training run with the candidate in place of its layer, in the judge.

A per-call check bounds one call's error; it cannot see an error that is harmless once and harmful
when training repeats it thousands of times (a consistent rounding direction, a gradient slightly
off). A task may declare (`[e2e]` in task.toml, tools/task.E2E) a trusted script, `e2e.py` in the task
folder, read-only like the spec, that defines

    train(kernel, seed: int, steps: int, device: torch.device) -> list[float]   # the loss of each step

It builds a small model and its data from `seed` (no downloads), runs `steps` optimiser steps with
`kernel` computing its layer, and returns the loss curve. `kernel(dims, inputs) -> outputs` takes a
shape's dims (as in the manifest) and the spec's input tensors (names, shapes and dtypes as the spec's
`make_inputs` draws them for those dims) and returns the spec's outputs as fresh tensors.

The judge runs the script twice from the same seed: once with the spec's reference as the kernel (in
the judge, rounded to the outputs' dtypes like a kernel's result), once with the candidate, which
still runs only in its sandboxed runner: every call goes through `RemoteKernel` onto buffers the
judge owns (inputs read-only, outputs poisoned first), like the check's calls. The model, the data,
the optimiser and the verdict stay in the judge. The verdict (`judge_losses`): every loss finite, none
above `diverge` times the reference's first loss, and the mean over the last `last` steps within
`bound` (relative) of the reference run's.
"""

from __future__ import annotations

import importlib.util
import math
import sys
import time
from pathlib import Path
from types import ModuleType

import torch

from tools.check import poison
from tools.protocol import E2EReport

ENTRY = "train"


class E2EError(Exception):
    """An e2e script that cannot be used, or a kernel call it made that does not fit the spec."""


def load_script(path: str | Path) -> ModuleType:
    path = Path(path).resolve()
    if not path.is_file():
        raise E2EError(f"{path}: the e2e script does not exist")
    name = f"kloop_e2e_{abs(hash(str(path)))}"
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise E2EError(f"{path}: cannot be imported as a Python module")
    module = importlib.util.module_from_spec(spec)
    saved, sys.dont_write_bytecode = sys.dont_write_bytecode, True  # never a __pycache__ in a task folder
    try:
        spec.loader.exec_module(module)
    except Exception as exc:
        raise E2EError(f"{path}: importing the e2e script raised {type(exc).__name__}: {exc}") from exc
    finally:
        sys.dont_write_bytecode = saved
    if not callable(getattr(module, ENTRY, None)):
        raise E2EError(f"{path}: no function {ENTRY}(kernel, seed, steps, device) -> list of losses")
    return module


class ReferenceKernel:
    """The spec's reference as the layer: computed in the judge, rounded to the outputs' dtypes (what a
    perfect kernel would write)."""

    def __init__(self, spec):
        self.spec = spec
        self.calls = 0

    def __call__(self, dims: dict, inputs: dict) -> dict:
        outs = self.spec.make_outputs(dims, inputs)
        ref = self.spec.reference(dims, inputs)
        self.calls += 1
        return {k: ref[k].to(outs[k].dtype) for k in ref if k in outs}  # workspaces have no reference


class RemoteKernel:
    """The candidate as the layer: each call copies the script's tensors into buffers the judge owns
    and the runner maps read-only (one set per distinct signature, bound once: later calls write new
    values into the same buffers), poisons the outputs, calls the library in its runner and returns
    copies of what it wrote. The names, shapes and dtypes must be the spec's for those dims."""

    def __init__(self, spec, lib, arena, device: torch.device):
        self.spec, self.lib, self.arena, self.device = spec, lib, arena, device
        self.slots: dict = {}
        self.calls = 0

    def __call__(self, dims: dict, inputs: dict) -> dict:
        sig = (tuple(sorted((k, str(v)) for k, v in dims.items())),
               tuple((k, tuple(v.shape), str(v.dtype)) for k, v in sorted(inputs.items())))
        slot = self.slots.get(sig)
        if slot is None:
            slot = self.slots[sig] = self._bind(dims, inputs)
        key, shared_in, outs = slot
        for k, v in inputs.items():
            shared_in[k].copy_(v.detach())
        poison(outs)
        self.lib.call([key])
        self.calls += 1
        return {k: v.clone() for k, v in outs.items()}

    def _bind(self, dims: dict, inputs: dict):
        gen = torch.Generator(device=self.device)
        gen.manual_seed(0)
        want = self.spec.make_inputs(dims, gen, self.device)  # what the spec's launch expects
        if set(want) != set(inputs):
            raise E2EError(f"kernel({dims}) got inputs {sorted(inputs)}, the spec's are {sorted(want)}")
        for k, t in want.items():
            v = inputs[k]
            if not isinstance(v, torch.Tensor) or tuple(v.shape) != tuple(t.shape) or v.dtype != t.dtype \
                    or v.device.type != t.device.type:
                got = f"{tuple(v.shape)} {v.dtype} on {v.device}" if isinstance(v, torch.Tensor) else type(v).__name__
                raise E2EError(f"kernel({dims}) input {k!r}: got {got}, the spec's is {tuple(t.shape)} {t.dtype} on {t.device}")
        shared_in = self.arena.share_dict({k: v.detach() for k, v in inputs.items()}, inputs=True)
        outs = self.arena.share_dict(self.spec.make_outputs(dims, shared_in))
        key = ("e2e", len(self.slots))
        self.lib.bind(key, dims, shared_in, outs)
        return key, shared_in, outs


def judge_losses(ref: list[float], cand: list[float], steps: int, last: int, bound: float,
                 diverge: float) -> tuple[bool, str, float | None, float | None]:
    """(passed, reason, ref_mean, cand_mean) of two loss curves of `steps` steps each."""
    for name, curve in (("reference", ref), ("candidate", cand)):
        if len(curve) != steps:
            return False, f"the {name} run returned {len(curve)} losses for {steps} steps (the e2e script is broken)", None, None
    if not all(math.isfinite(x) for x in ref):
        return False, "the reference run's loss is not finite (the e2e script is broken)", None, None
    rm = sum(ref[-last:]) / last
    bad = next((i for i, x in enumerate(cand) if not math.isfinite(x)), None)
    if bad is not None:
        return False, f"training broke: loss {cand[bad]} at step {bad + 1} of {steps} (reference {ref[bad]:.4g})", rm, None
    cm = sum(cand[-last:]) / last
    limit = diverge * abs(ref[0])
    over = next((i for i, x in enumerate(cand) if x > limit), None)
    if over is not None:
        return False, (f"training diverged: loss {cand[over]:.4g} at step {over + 1} of {steps}, over {diverge:g}x "
                       f"the reference run's first loss {ref[0]:.4g}"), rm, cm
    rel = (cm - rm) / abs(rm) if rm != 0 else (0.0 if cm == 0 else math.inf)
    # digits enough to read the figures against the bound (a 0.004% bound needs 6 significant digits)
    tight = min(12, max(0, math.ceil(-math.log10(bound)))) if 0 < bound < 1 else 0
    sig, dec = max(4, tight + 1), max(2, tight - 1)
    text = (f"last-{last} mean loss {cm:.{sig}g} vs {rm:.{sig}g} ref ({rel * 100:+.{dec}f}%, bound {bound * 100:g}%), "
            f"{steps} steps")
    if abs(rel) > bound:
        return False, f"training moved off the reference: {text}", rm, cm
    return True, text, rm, cm


def e2e_in_process(task, spec, lib, seed: int, device: torch.device, arena) -> E2EReport:
    """The reference run, then the candidate's (through `lib`, a tools.remote.RemoteLib), from `seed`."""
    from tools.runner import RunnerError

    cfg = task.manifest.e2e
    if cfg is None:
        return E2EReport(passed=False, reason=f"task {task.name} declares no e2e check")
    started = time.monotonic()
    common = dict(steps=cfg.steps, last=cfg.last, bound=cfg.bound)
    try:
        script = load_script(task.e2e_path)
        ref = _losses(script.train(ReferenceKernel(spec), seed, cfg.steps, device))
    except Exception as exc:
        return E2EReport(passed=False, reason=f"the e2e script failed on the reference run: {type(exc).__name__}: {exc}",
                         seconds=round(time.monotonic() - started, 3), **common)
    ref_s = time.monotonic() - started
    kernel = RemoteKernel(spec, lib, arena, device)
    try:
        cand = _losses(script.train(kernel, seed, cfg.steps, device))
    except RunnerError as exc:
        return E2EReport(passed=False, reason=f"the candidate failed during the e2e run (call {kernel.calls + 1}): {exc}",
                         ref_losses=_json(ref), calls=kernel.calls, seconds=round(time.monotonic() - started, 3), **common)
    except Exception as exc:  # e.g. torch refusing a NaN the candidate wrote
        return E2EReport(passed=False, reason=f"the e2e run with the candidate failed: {type(exc).__name__}: {exc}",
                         ref_losses=_json(ref), calls=kernel.calls, seconds=round(time.monotonic() - started, 3), **common)
    passed, reason, rm, cm = judge_losses(ref, cand, cfg.steps, cfg.last, cfg.bound, cfg.diverge)
    total = time.monotonic() - started
    return E2EReport(passed=passed, reason=reason, ref_mean=rm, cand_mean=cm, ref_losses=_json(ref),
                     cand_losses=_json(cand), calls=kernel.calls, seconds=round(total, 3),
                     ref_seconds=round(ref_s, 3), cand_seconds=round(total - ref_s, 3), **common)


def _losses(curve) -> list[float]:
    return [float(x) for x in curve]


def _json(curve: list[float]) -> list[float | None]:
    return [x if math.isfinite(x) else None for x in curve]


def due(when: str, accepts_since_last: int) -> bool:
    """Does the gate run the e2e on this accept? `accepts_since_last`: accepts since the last e2e ran
    (this one not counted). `every:N` runs on the N-th accept, judging the N changes together."""
    if when == "export":
        return False
    n = 1 if when == "accept" else int(when.split(":", 1)[1])
    return accepts_since_last + 1 >= n


def summary(report: E2EReport | dict) -> str:
    """One line for trailers and views: `pass, last-10 mean loss 2.314 vs 2.311 ref (+0.13%, bound 1%), 40 steps, 3.2 s`."""
    r = report if isinstance(report, E2EReport) else E2EReport.model_validate(report)
    reason = r.reason.removeprefix("training moved off the reference: ")
    return f"{'pass' if r.passed else 'FAIL'}, {reason}, {r.seconds:.1f} s"
