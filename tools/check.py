"""Correctness: does the kernel compute the spec's function on fresh random inputs?

Runs in the judge (tools/worker.py); the library runs in its own runner process (tools/libhost.py). Every check shape is called `rounds` times: the first call on
freshly drawn inputs, later calls on new values written into the *same* buffers (a kernel that
caches results by pointer or returns the previous call's output fails there). Outputs are poisoned
before every call, inputs are verified bit-identical afterwards, and the reference is computed only
after every candidate call has run, so no reference output exists in memory while the kernel runs.
"""

from __future__ import annotations

import math
import time

import torch

from tools.task import Task
from tools.draws import SecretDraws
from tools.protocol import CheckReport, OutputError, ShapeCheck
from tools.spec import Spec

INT_POISON = -0x5A5A5A5A


def poison(outputs: dict[str, torch.Tensor]) -> None:
    for t in outputs.values():
        if t.is_floating_point() or t.is_complex():
            t.fill_(float("nan"))
        elif t.dtype == torch.bool:
            t.fill_(True)
        else:
            t.fill_(max(INT_POISON, torch.iinfo(t.dtype).min))


def refill(inputs: dict, fresh: dict) -> bool:
    """Write `fresh` values into the existing input buffers (same addresses, new values).

    Returns False, changing nothing, when the spec drew tensors of another shape or dtype this time
    (then the caller must use `fresh` itself)."""
    compatible = all(
        k in inputs and (not isinstance(t, torch.Tensor) or (isinstance(inputs[k], torch.Tensor)
                         and inputs[k].shape == t.shape and inputs[k].dtype == t.dtype))
        for k, t in fresh.items()
    ) and set(inputs) == set(fresh)
    if not compatible:
        return False
    for k, t in fresh.items():
        if isinstance(t, torch.Tensor):
            inputs[k].copy_(t)
        else:
            inputs[k] = t
    return True


def snapshot(inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in inputs.items() if isinstance(v, torch.Tensor)}


def changed_inputs(before: dict[str, torch.Tensor], inputs: dict[str, torch.Tensor]) -> list[str]:
    """Names of inputs whose bytes differ from the snapshot (bitwise: NaN == NaN here)."""
    changed = []
    for name, old in before.items():
        new = inputs[name]
        if old.shape != new.shape or not torch.equal(_bits(old), _bits(new)):
            changed.append(name)
    return changed


def _bits(t: torch.Tensor) -> torch.Tensor:
    t = t.contiguous()
    return t.view(torch.uint8) if t.numel() else t


_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def differing_elements(a: torch.Tensor, b: torch.Tensor) -> int:
    """How many elements of two same-shaped tensors differ bitwise (NaN == NaN here); all of them when
    the shapes or dtypes differ."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return max(a.numel(), b.numel())
    if not a.numel():
        return 0
    as_int = _INT_OF_SIZE.get(a.element_size())
    if as_int is None or a.dtype == torch.bool:
        return int((_bits(a).reshape(a.numel(), -1) != _bits(b).reshape(b.numel(), -1)).any(dim=1).sum())
    return int((a.contiguous().reshape(-1).view(as_int) != b.contiguous().reshape(-1).view(as_int)).sum())


_NARROW_FLOATS = {torch.float16, torch.bfloat16, torch.float32}
for _name in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz"):
    if hasattr(torch, _name):
        _NARROW_FLOATS.add(getattr(torch, _name))


def compare(name: str, got: torch.Tensor | None, want: torch.Tensor, atol: float, rtol: float,
            norm_rtol: float | None) -> OutputError:
    """Error of one output against its reference; NaN/Inf in the output never pass.

    Computed in fp32 when both sides are floats of at most 32 bits (exact for them; its rounding,
    ~6e-8 relative, is far below any tolerance) and in fp64 otherwise, with the figures read back in
    one transfer: the gate re-checks timed calls every pass, and on a 268M-element output the fp64
    version's temporaries were most of a decision's seconds on the H200."""
    if got is None:
        return OutputError(name=name, passed=False, problem="the kernel has no such output")
    if tuple(got.shape) != tuple(want.shape):
        return OutputError(name=name, passed=False, problem=f"shape {tuple(got.shape)} != reference {tuple(want.shape)}")
    numel = want.numel()
    if numel == 0:
        return OutputError(name=name, passed=True, numel=0)
    dt = torch.float32 if got.dtype in _NARROW_FLOATS and want.dtype in _NARROW_FLOATS else torch.float64
    g = got.detach().to(want.device, dt).flatten()
    w = want.detach().to(dt).flatten()
    quick = _passing_finite(name, g, w, atol, rtol, norm_rtol, numel)
    return quick if quick is not None else _general(name, g, w, atol, rtol, norm_rtol, numel, tuple(want.shape), dt)


def passes_clearly(got: torch.Tensor | None, want: torch.Tensor, atol: float, rtol: float, norm_rtol: float | None) -> bool:
    """True when the output passes `compare` with a margin, from about 8 passes over memory instead of
    `compare`'s 13 or more (the gate's timed re-checks need a verdict, not figures; on the H200 they
    were 39% of a 268M-element softmax decision's timing loop). False decides nothing: `compare` then
    does, exactly. Pass or fail is the same as `compare`'s: every element within atol + rtol x |want|
    (checked as max(|got - want| - rtol x |want|) <= atol less a relative 1e-5, so rounding at a bound
    never tips it), every value finite, the error's norm within norm_rtol of the reference's."""
    if got is None or tuple(got.shape) != tuple(want.shape) or not want.numel():
        return False
    if not (got.dtype in _NARROW_FLOATS and want.dtype in _NARROW_FLOATS):
        return False  # fp64 and integer outputs: compare's general path
    w = want.detach().to(torch.float32)
    diff = torch.sub(got.detach().to(w.device), w).abs_()  # fp32 by promotion: no copy of got in fp32
    err_norm, ref_norm = torch.linalg.vector_norm(diff), torch.linalg.vector_norm(w)  # NaN or Inf anywhere shows here
    worst = diff.addcmul_(w.abs(), torch.full((), -rtol, device=w.device)).max()
    figures = torch.stack([err_norm, ref_norm, worst]).tolist()
    if not all(math.isfinite(x) for x in figures):
        return False
    err_norm, ref_norm, worst = figures
    if worst > atol * (1 - 1e-5) - 1e-30:
        return False
    return norm_rtol is None or (ref_norm > 0 and err_norm <= norm_rtol * ref_norm * (1 - 1e-5))


def _passing_finite(name: str, g: torch.Tensor, w: torch.Tensor, atol: float, rtol: float, norm_rtol: float | None,
                    numel: int) -> OutputError | None:
    """The figures of an output that passes with every difference finite (the gate's re-checks, nearly
    always): the same numbers as `_general`, from 13 passes over memory instead of about 28 (a 268M-element
    re-check is most of a pass's seconds on the H200). None where some difference is not finite or the
    output fails: `_general` then decides, and says where it is worst."""
    diff = torch.sub(g, w).abs_()
    aw = w.abs()
    bound = aw.mul(rtol).add_(atol)  # the same operations, in the same order, as `_general`'s bound
    mismatches = torch.gt(diff, bound).sum()
    del bound
    max_abs, err_norm = diff.max(), torch.linalg.vector_norm(diff)
    rel = diff.div_(aw.clamp_min_(max(atol, 1e-30))).max()
    stats = torch.stack([max_abs.to(torch.float64), mismatches.to(torch.float64), rel.to(torch.float64),
                         torch.linalg.vector_norm(w).to(torch.float64), err_norm.to(torch.float64)]).tolist()
    if not all(math.isfinite(x) for x in stats) or stats[1] != 0:  # a NaN or Inf anywhere shows in the max
        return None
    ref_norm, err_norm = stats[3], stats[4]
    norm_rel = err_norm / ref_norm if ref_norm > 0 else (0.0 if err_norm == 0 else float("inf"))
    if norm_rtol is not None and not norm_rel <= norm_rtol:
        return None
    return OutputError(name=name, passed=True, max_abs=stats[0], max_rel=stats[2], norm_rel=norm_rel,
                       nonfinite=0, mismatches=0, numel=numel)


def _general(name: str, g: torch.Tensor, w: torch.Tensor, atol: float, rtol: float, norm_rtol: float | None,
             numel: int, shape: tuple[int, ...], dt: torch.dtype) -> OutputError:
    """Any output, non-finite values on either side included, and where a failing one is worst."""
    ref_finite = torch.isfinite(w)
    # where the reference itself is not finite the output must match it exactly (e.g. -inf LSE);
    # a NaN reference is matched by nothing
    matched = ~ref_finite & (g == w)
    nonfinite = (~torch.isfinite(g) & ~matched).sum()
    aw = w.abs()
    # the error where the reference is finite (inf where the output is not), else 0 or inf as matched
    diff = torch.where(ref_finite, (g - w).abs().nan_to_num(nan=float("inf")),
                       torch.where(matched, 0.0, float("inf")).to(dt))
    bound = atol + rtol * torch.where(ref_finite, aw, 0.0)
    bad = diff > bound
    finite_diff = torch.where(ref_finite, diff, 0.0)
    scale = aw.clamp_min(max(atol, 1e-30))
    stats = torch.stack([
        nonfinite.to(torch.float64), bad.sum().to(torch.float64),
        finite_diff.max().to(torch.float64), (finite_diff / scale).max().to(torch.float64),
        torch.linalg.vector_norm(torch.where(ref_finite, w, 0.0)).to(torch.float64),
        torch.linalg.vector_norm(finite_diff).to(torch.float64),
        ref_finite.any().to(torch.float64)]).tolist()
    nonfinite, mismatches = int(stats[0]), int(stats[1])
    any_finite = bool(stats[6])
    max_abs, max_rel = (stats[2], stats[3]) if any_finite else (0.0, 0.0)
    ref_norm, err_norm = stats[4], stats[5]
    norm_rel = err_norm / ref_norm if ref_norm > 0 else (0.0 if err_norm == 0 else float("inf"))
    passed = nonfinite == 0 and mismatches == 0 and (norm_rtol is None or norm_rel <= norm_rtol)
    err = OutputError(name=name, passed=passed, max_abs=max_abs, max_rel=max_rel, norm_rel=norm_rel,
                      nonfinite=nonfinite, mismatches=mismatches, numel=numel)
    if not passed:  # where it is worst: the element furthest outside its bound (or the largest error)
        # among the elements out of bounds, by how far (a ratio); where none is (a norm over its bound), the
        # largest error. (Once ratio and raw error were mixed, so a within-bounds element with a large
        # error was named the worst over the one out of bounds.)
        ratio = diff / bound.clamp_min(torch.finfo(dt).tiny)
        worst = int(torch.argmax(torch.where(bad, ratio, -1.0)) if mismatches else torch.argmax(diff))
        err.worst_index = list(_unravel(worst, shape))
        err.worst_got, err.worst_want = float(g[worst]), float(w[worst])
    return err


def _unravel(flat: int, shape: tuple[int, ...]):
    out = []
    for dim in reversed(shape):
        out.append(flat % dim if dim else 0)
        flat //= dim if dim else 1
    return reversed(out)


def check_in_process(task: Task, spec: Spec, lib, shapes: list[str], seed: int, rounds: int,
                     device: torch.device, arena=None, relaunch=None) -> CheckReport:
    """Check the library behind `lib` (a tools.remote.RemoteLib: it runs in its own runner process).

    Inputs are drawn here from the secret seed, placed in shared memory the runner maps (read-only on
    the CPU) and outputs the runner writes are read back here and compared here. `relaunch()` gives a
    fresh runner with the same library: after a fault it tells a write into a read-only input apart
    from any other crash (the call again, on writable copies of the inputs)."""
    from tools.runner import RunnerError

    started = time.monotonic()
    draws = SecretDraws(seed, device, "check")  # no set's values tell the next one's (tools/draws.py)
    share = arena.share_dict if arena is not None else (lambda d, inputs=False: d)
    # phase 1: every candidate call, keeping copies of what it was given and what it wrote
    runs = []  # (shape, round, dims, inputs copy, outputs copy, changed, error)
    dead = None
    for name in shapes:
        dims = task.shape(name).dims
        if dead is not None:
            runs.append((name, 0, dims, None, None, [], f"not run: {dead}"))
            continue
        inputs = outputs = before = None
        key = None
        for rnd in range(rounds):
            try:
                fresh = spec.make_inputs(dims, draws.next(), device)
                if inputs is None or not refill(inputs, fresh):  # later rounds: new values, same addresses
                    inputs = share(fresh, inputs=True)
                    outputs = share(spec.make_outputs(dims, inputs))
                    key = (name, rnd)
                    lib.bind(key, dims, inputs, outputs)
                del fresh
                poison(outputs)
                before = snapshot(inputs)
                _sync(device)
                lib.call([key])
                changed = changed_inputs(before, inputs)
                runs.append((name, rnd, dims, before, snapshot(outputs), changed, None))
            except RunnerError as exc:
                try:
                    wrote, undiagnosed = _wrote_inputs(exc, spec, dims, before, arena, relaunch, device), ""
                except Exception as diag:  # the crash stands; say the diagnosis did not run, not nothing
                    wrote, undiagnosed = [], f" (whether it wrote into its inputs is unknown: the diagnosis failed: {diag})"
                if wrote:
                    runs.append((name, rnd, dims, before, None, wrote, None))
                else:
                    runs.append((name, rnd, dims, None, None, [], _runner_failure(exc, device) + undiagnosed))
                if exc.kind != "call":  # crashed, hung or lied: this runner is gone
                    dead = f"the runner stopped at shape {name} call {rnd}"
                break
        del inputs, outputs
    # phase 2: references, computed only now
    results = []
    for name, rnd, dims, inputs, outputs, changed, error in runs:
        if error is not None:
            results.append(ShapeCheck(shape=name, dims=dims, round=rnd, passed=False, error=error))
            continue
        if outputs is None:  # the call faulted writing into its read-only inputs
            results.append(ShapeCheck(shape=name, dims=dims, round=rnd, passed=False, inputs_changed=changed))
            continue
        ref = spec.reference(dims, inputs)
        errs = []
        for out_name, want in ref.items():
            tol = task.tolerance(out_name)
            errs.append(compare(out_name, outputs.get(out_name), want, tol.atol, tol.rtol, tol.norm_rtol))
        passed = all(e.passed for e in errs) and not changed
        results.append(ShapeCheck(shape=name, dims=dims, round=rnd, passed=passed, outputs=errs, inputs_changed=changed))
        del ref
    return CheckReport(passed=all(r.passed for r in results) and bool(results), shapes=results,
                       seconds=round(time.monotonic() - started, 3))


def _wrote_inputs(exc, spec: Spec, dims: dict, before, arena, relaunch, device: torch.device) -> list[str]:
    """After a CPU fault: the same call in a fresh runner on copy-on-write copies of the inputs; the
    names of the inputs it wrote into (even if it restored them): the runner reads its own memory map
    (/proc/self/smaps: written pages became private; the judge cannot read a hardened runner's). It
    only names what faulted already (the verdict is a failure either way), so its word is enough.
    Empty: the crash was something else. Raises when the diagnosis itself fails."""
    from tools.runner import RunnerError

    if exc.kind != "crash" or device.type != "cpu" or relaunch is None or arena is None or before is None:
        return []
    if "SIGSEGV" not in str(exc) and "SIGBUS" not in str(exc):
        return []
    lib = None
    try:
        lib = relaunch()
        copies = arena.share_dict({k: v.clone() for k, v in before.items()})
        outputs = arena.share_dict(spec.make_outputs(dims, copies))
        lib.bind("diagnose", dims, copies, outputs, writable_inputs=True)
        try:
            lib.call(["diagnose"])
        except RunnerError:  # it faults on writable inputs too: the crash was something else
            return []
        written = lib.runner.request("written_inputs", lib.call_timeout, key="diagnose").get("names")
        named = sorted(n for n in written if n in copies) if isinstance(written, list) else []
        return named or changed_inputs(before, copies)
    finally:
        if lib is not None:
            lib.runner.close()


def _runner_failure(exc, device: torch.device) -> str:
    """The failure as the check reports it. A CPU fault gets no 'writes into its inputs' hint: where
    the kernel did write into its read-only inputs, `_wrote_inputs` found it and the shape says so."""
    text = str(exc)
    if device.type == "cuda" and _cuda_context_broken(exc):
        text += (" (inputs are mapped read-only on the device: a kernel that writes into its inputs, even to"
                 " restore them, faults with an illegal address)")
    return text


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _sync_quietly(device: torch.device) -> None:
    try:
        _sync(device)
    except Exception:
        pass


def _cuda_context_broken(exc: Exception) -> bool:
    text = str(exc).lower()
    return "illegal" in text or "misaligned" in text or "unspecified launch failure" in text


def format_check(report: CheckReport) -> str:
    """One row per shape and output: the errors, and what failed."""
    rows = [f"{'shape':<18} {'rnd':>3} {'output':<8} {'max_abs':>10} {'max_rel':>10} {'norm_rel':>10} {'bad':>8}  verdict"]
    for s in report.shapes:
        if s.error:
            rows.append(f"{s.shape:<18} {s.round:>3} {'-':<8} {'':>10} {'':>10} {'':>10} {'':>8}  FAIL: {s.error}")
            continue
        for o in s.outputs:
            verdict = "ok" if o.passed else "FAIL"
            why = []
            if o.problem:
                why.append(o.problem)
            if o.nonfinite:
                why.append(f"{o.nonfinite} NaN/Inf (unwritten or invalid)")
            if o.mismatches:
                why.append(f"{o.mismatches}/{o.numel} outside tolerance; worst at {o.worst_index}: got {_g(o.worst_got, '.6g')} want {_g(o.worst_want, '.6g')}")
            if not o.passed and not why:
                why.append("norm error over tolerance")
            rows.append(
                f"{s.shape:<18} {s.round:>3} {o.name:<8} {_g(o.max_abs):>10} {_g(o.max_rel):>10} {_g(o.norm_rel):>10} "
                f"{o.mismatches:>8}  {verdict}{': ' + '; '.join(why) if why else ''}"
            )
        if s.inputs_changed:
            rows.append(f"{s.shape:<18} {s.round:>3} {'inputs':<8} FAIL: the kernel wrote into its inputs {s.inputs_changed}")
    rows.append(f"check {'PASSED' if report.passed else 'FAILED'} ({len(report.failures())} failing of {len(report.shapes)}, {report.seconds:.1f} s)")
    return "\n".join(rows)


def _g(x: float | None, fmt: str = ".3g") -> str:
    """A report number as text; None (NaN/Inf after a JSON round trip) prints as '-', never raises."""
    if x is None:
        return "-"
    try:
        return format(x, fmt)
    except (TypeError, ValueError):
        return str(x)


def describe_error(err: OutputError) -> str:
    """What is wrong with one output, for a reason text (robust to missing fields)."""
    if err.problem:
        return err.problem
    return f"{err.mismatches} wrong, {err.nonfinite} NaN/Inf, max_abs {_g(err.max_abs)}"
