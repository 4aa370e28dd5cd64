"""Requests to and answers from the evaluation worker: plain data, serialisable, versioned by shape.

Everything untrusted (the candidate's library) runs in the worker; the parent only ever reads these
models back from a file, so a worker that crashes, hangs or lies about its types cannot hurt it.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field


class DeviceInfo(BaseModel):
    """Where a number was measured."""

    kind: Literal["cuda", "cpu"]
    name: str
    driver: str | None = None
    cuda_runtime: str | None = None  # the CUDA version torch was built with
    torch: str | None = None
    sm_clock_mhz: int | None = None
    max_sm_clock_mhz: int | None = None
    mem_clock_mhz: int | None = None
    sm_count: int | None = None
    l2_bytes: int | None = None
    host: str | None = None

    def label(self) -> str:
        from tools.fmt import device_label

        return device_label(self)


# ---- correctness --------------------------------------------------------------------------------

class OutputError(BaseModel):
    name: str
    passed: bool
    max_abs: float | None = None
    max_rel: float | None = None
    norm_rel: float | None = None
    nonfinite: int = 0  # NaN/Inf in the kernel's output (poison left unwritten shows up here)
    mismatches: int = 0  # elements outside atol + rtol * |ref|
    numel: int = 0
    worst_index: list[int] = Field(default_factory=list)
    worst_got: float | None = None
    worst_want: float | None = None
    problem: str | None = None  # shape/dtype mismatch, missing output


class ShapeCheck(BaseModel):
    shape: str
    dims: dict
    round: int  # which call on this shape (later rounds reuse the buffers with new values)
    passed: bool
    outputs: list[OutputError] = Field(default_factory=list)
    inputs_changed: list[str] = Field(default_factory=list)
    error: str | None = None


class CheckReport(BaseModel):
    passed: bool
    shapes: list[ShapeCheck] = Field(default_factory=list)
    seconds: float = 0.0

    def failures(self) -> list[ShapeCheck]:
        return [s for s in self.shapes if not s.passed]


# ---- timing -------------------------------------------------------------------------------------

class Timing(BaseModel):
    """Times of one callable on one shape, in seconds per call."""

    median: float
    p10: float
    p90: float
    mean: float
    samples: int
    calls_per_sample: int = 1
    input_sets: int = 1
    tflops: float | None = None
    gbps: float | None = None
    wall_median: float | None = None  # host clock around call + device sync (escape detection)


class ShapeBench(BaseModel):
    shape: str
    dims: dict
    flops: float | None = None
    bytes: float | None = None
    kernel: Timing | None = None
    comparators: dict[str, Timing] = Field(default_factory=dict)
    comparator_errors: dict[str, str] = Field(default_factory=dict)
    error: str | None = None


class BenchReport(BaseModel):
    shapes: list[ShapeBench] = Field(default_factory=list)
    seconds: float = 0.0


class ShapeAB(BaseModel):
    """Paired timings of best (A) and candidate (B) on one shape; speedup = sum tA / sum tB over the
    passes (> 1: B faster), every timed call counted (tools/stats.py)."""

    shape: str
    weight: float
    pairs: int  # paired samples (each of calls_per_sample calls per side)
    log_speedup: float = 0.0  # log(sum tA / sum tB)
    log_speedup_se: float = 1e9  # its delta-method standard error over passes
    speedup: float
    speedup_lo: float  # the interval at the report's one-sided level `ABReport.alpha` (each bound)
    speedup_hi: float
    # mean seconds per call over every timed call of the shape, from the same pass sums as the speedup
    # (so speedup == time_a / time_b)
    time_a: float
    time_b: float
    # per pass: that pass's mean seconds per call, of A and of B (the data the gate decides from)
    pass_a: list[float] = Field(default_factory=list)
    pass_b: list[float] = Field(default_factory=list)
    # integrity probes, taken cold (L2 flushed, same input-set rotation) for A and B alike, interleaved
    # with the timed pairs: wall = host seconds per call until the device is idle; extra = seconds per
    # call spent outside what was timed (CUDA: wall minus events; CPU: CPU time of the process beyond
    # the wall time, i.e. other threads at work); idle_cpu = CPU seconds the process used while idle
    # after its calls returned (work after return). None or NaN: not measured, and the gate fails closed.
    wall_a: float | None = None
    wall_b: float | None = None
    extra_a: float | None = None
    extra_b: float | None = None
    idle_cpu_a: float | None = None
    idle_cpu_b: float | None = None
    probes: int = 0
    # the cold probes' own call time, the mean over every probe of the side (a probe is a call no sample
    # charges: what it costs beyond a cold call is bounded like for like by the gate). None: not measured
    probe_call_a: float | None = None
    probe_call_b: float | None = None
    # the standard error of extra_a's lower quartile, from the spread of the best's own probes (robust:
    # 1.4826 MAD): the escape allowance is a few of these. None/NaN: not measured (fail closed)
    extra_a_se: float | None = None
    # CPU seconds per timed call each runner used after answering (over every timed call, not only the
    # probes); an honest runner sits blocked on its pipe. Also included in extra_*.
    after_return_a: float | None = None
    after_return_b: float | None = None
    # CUDA: seconds per call the device stayed busy after a timed sample's end event (on the device's clock,
    # until every stream of the runner's context was idle), the lower quartile over every timed sample of each
    # side, and the robust standard error of the best's. Work left on another stream shows here whole.
    # None: not a CUDA timing; NaN: not measured (the gate fails closed)
    trail_a: float | None = None
    trail_b: float | None = None
    trail_a_se: float | None = None
    trail_samples: int = 0
    # CUDA: seconds per call of the judge's own wall clock around each timed request beyond the times the
    # runner reported (pipe, spin, syncs: the same for any library; the flush before it is the judge's), the lower quartile over every timed
    # sample of each side and the robust standard error of the best's. A runner whose events under-report
    # shows here, on a clock it cannot reach. None: not a CUDA timing; NaN: not measured
    offclock_a: float | None = None
    offclock_b: float | None = None
    offclock_a_se: float | None = None
    calls_per_sample: int = 1  # calls in one timed sample (short kernels are timed several to a sample)
    floor_s: float | None = None  # physics floor: no honest call can take less (roofline at generous peaks)
    passes: int = 0  # passes over the input sets (fresh values and poisoned outputs before each)
    rechecked: int = 0  # candidate outputs of timed calls checked against the reference
    baseline_a: float | None = None  # the best's time recorded when it was accepted (sabotage check)
    timed_outputs_ok: bool = True
    timed_outputs_problem: str | None = None


class ABReport(BaseModel):
    shapes: list[ShapeAB] = Field(default_factory=list)
    # the workload's speedup: sum over passes of A's workload time (weight x seconds per call, summed
    # over shapes) over B's, with its interval (each bound at one-sided level `alpha`)
    speedup: float = 1.0
    speedup_lo: float = 1.0
    speedup_hi: float = 1.0
    passes: int = 0
    look: int = 1  # which timed decision against this best (1: the first)
    alpha: float = 0.0061  # this look's one-sided level (tools/stats.look_alpha)
    pairs: int = 0
    timing_seconds: float = 0.0
    # wall seconds of the timing loop by part: "paired samples" (the timed calls, flushes and requests),
    # "fresh inputs", "re-checks", "probes": where a decision's seconds go beyond the timed calls
    pass_seconds: dict[str, float] = Field(default_factory=dict)
    stopped_because: str = ""
    # how the runners' time was read (tools/remote.py): "cpu" (the runner's CPU clock), "wall" (CPU tasks
    # whose manifest allows threads: the judge's wall clock around each request) or "events" (CUDA)
    measure: str = ""
    # CPU tasks: how many CPUs the judge drew each pair's from (tools/placement.py: both sides of a pair on the
    # same CPUs); 0 where nothing was drawn (CUDA, or no more CPUs than a side's threads)
    placed_from_cpus: int = 0
    placement_error: str | None = None  # where the host refused the pinning (the decision went on unplaced)
    # the candidate's runner, CPU seconds: inside timed requests, and in no request at all (after an
    # answer, before the next request: frozen runners use ~none; it is charged to a sample all the same)
    cpu_in_samples_b: float | None = None
    cpu_between_requests_b: float | None = None
    max_parallelism_b: float | None = None  # the largest CPU / wall of one timed request (threads at work)
    cpu_unattributed_b: float | None = None  # its CPU charged to no sample, probe or untimed call (0: books close)


# ---- end to end --------------------------------------------------------------------------------

class E2EReport(BaseModel):
    """A short training run with the candidate in place of its layer against the same run with the
    spec's reference (same seed, same data), judged on the loss curve (tools/e2e.py)."""

    passed: bool
    reason: str
    steps: int = 0
    last: int = 0  # the mean is over the last `last` steps
    bound: float = 0.0  # relative bound on the difference of the means
    ref_mean: float | None = None
    cand_mean: float | None = None
    ref_losses: list[float | None] = Field(default_factory=list)  # None: not finite (JSON has no NaN)
    cand_losses: list[float | None] = Field(default_factory=list)
    calls: int = 0  # candidate calls through its runner
    seconds: float = 0.0  # both runs
    ref_seconds: float = 0.0
    cand_seconds: float = 0.0


# ---- the envelope -------------------------------------------------------------------------------

class WorkerRequest(BaseModel):
    # gate: check the candidate, then (if it passes) ab; e2e: the task's end-to-end training check
    kind: Literal["check", "bench", "ab", "gate", "probe", "e2e"]
    task_dir: str  # trusted manifest + spec come from here
    libs: list[str] = Field(default_factory=list)  # check: [lib]; bench: [lib, ...]; ab and gate: [best, candidate]
    shapes: list[str] = Field(default_factory=list)
    check_shapes: list[str] = Field(default_factory=list)  # gate: the shapes to check (shapes: to time)
    seed: int = 0
    timing_seed: int = 0  # gate: the seed of the timing (seed is the check's)
    rounds: int = 2  # check: calls per shape, later ones reuse the buffers with fresh values
    comparators: bool = True
    max_seconds: float = 4.0  # bench: per shape; ab: timing for the whole decision
    min_pairs: int = 20
    target_halfwidth: float = 0.004  # ab: stop once the log-speedup interval is this tight
    noisy_halfwidth: float = 0.10  # ab: an interval wider than this (half, in log) decides nothing (GateConfig)
    cpu_placement: Literal["current", "off"] = "current"  # ab, CPU tasks: tools/placement.py (GateConfig)
    cuda_placement: Literal["current", "off"] = "off"  # ab, CUDA tasks: the same for the runners' host threads
    cuda_request_s: float = Field(default=50e-6, gt=0, le=0.1)  # ab, CUDA tasks: seconds of calls per timed request
    alpha: float = 0.0061  # ab: the one-sided level of this look (the gate's spent budget, tools/stats.look_alpha)
    look: int = 1  # ab: which timed look at this best (recorded in the report)
    min_gain: float = 0.01
    allowances: dict[str, float] = Field(default_factory=dict)  # ab: per-shape regression allowance
    weights: dict[str, float] = Field(default_factory=dict)
    # ab: independent decisions on the same two runners (the gate benchmark); each draws its own
    # timing seed from `seed` in the judge, fresh input sets and its own statistics
    trials: int = 1
    trials_seconds: float = 0.0  # ab with trials > 1: start no new trial after this many seconds (0: no limit)
    # gate: also run the task's e2e check (tools/e2e.py) in the same judge once the timing's lower bound
    # clears min_gain (a condition every accept needs): it saves a judge start per accept. The gate
    # uses it only if the verdict is an accept, and runs a judge of its own when none came back
    e2e: bool = False
    e2e_seed: int = 0


class WorkerResult(BaseModel):
    ok: bool
    error: str | None = None
    device: DeviceInfo | None = None
    check: CheckReport | None = None
    bench: BenchReport | None = None
    ab: ABReport | None = None
    # the worker's timing saw device work outside the stream it timed
    warnings: list[str] = Field(default_factory=list)
    # seconds the judge spent per stage: start (imports, runners up; 0 when it was pre-started and
    # ready), load (the libraries into their runners), check, timing
    stage_seconds: dict[str, float] = Field(default_factory=dict)
    # the judge: "cold" (started for this request), or a pre-started standby (tools/judge_handle.JudgeStandby)
    # that was "ready" (warmed up) or still "warming" when the request was sent
    standby: Literal["cold", "warming", "ready"] = "cold"
    e2e: E2EReport | None = None
    trials: list[ABReport] = Field(default_factory=list)  # ab with trials > 1: one report per trial
    trial_seconds: list[float] = Field(default_factory=list)  # wall seconds of each trial in the judge
    # bench of several libraries (a sweep): per library, in request order, its report or why it has none
    benches: list[BenchReport | None] = Field(default_factory=list)
    bench_errors: list[str | None] = Field(default_factory=list)
