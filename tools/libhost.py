"""The runner: `python -m tools.libhost CMD_FD REPLY_FD` — the only process that loads a candidate's library.

It is untrusted the moment the library loads, so it decides nothing: it maps the buffers the judge
allocated (CPU inputs read-only, so a write into an input faults), calls `spec.launch` on them when
asked, and answers with plain JSON (status, and on CUDA its event times). The judge (tools/worker.py)
draws the inputs, keeps the seed, computes the references, compares, times and decides.

Messages judge -> runner are pickled (trusted to untrusted); runner -> judge are one JSON object per
line on a dedicated pipe (never the library's stdout), echoing the request's nonce.
"""

from __future__ import annotations

if __name__ == "__main__":
    # a runner: no capability from here on, before torch starts any thread. Capabilities belong to threads,
    # and harden_process() after the import dropped only the main thread's: a thread torch had started kept
    # CAP_SYS_ADMIN where the judge held it (the judge could then not even pin it: tools/placement.py)
    from tools.sandbox import drop_capabilities

    drop_capabilities()

import ctypes
import json
import mmap
import os
import pickle
import socket
import struct
import sys
import time
import traceback
import warnings

import torch  # imported before any untrusted code loads (and so the library cannot race it)

from tools.sandbox import harden_process, threads_with_capabilities
from tools.spec import load_spec
from tools.timing import CUDA_LIMIT_PERSISTING_L2_CACHE_SIZE, cudart, hold_device
from tools.triton_launch import TritonModule  # ctypes only: no Triton in a runner

_DTYPES = {str(d): d for d in (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8, torch.uint8,
                               torch.int16, torch.int32, torch.int64, torch.bool,
                               *(getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2") if hasattr(torch, n)))}


class Host:
    def __init__(self, cmd_fd: int, reply_fd: int, fd_sock: int | None = None):
        self.cmd = os.fdopen(cmd_fd, "rb", buffering=0)
        self.reply_fd = reply_fd
        self.fd_sock = socket.socket(fileno=fd_sock) if fd_sock is not None else None
        self.spec = None
        self.lib = None
        self.device = torch.device("cpu")
        self.stream = 0
        self.sets: dict = {}  # key -> (dims, inputs, outputs)
        self.maps: list[mmap.mmap] = []
        self.enqueue_per_call_s = 0.0  # host time to launch one call, seen lately (Triton tasks only)
        self.launch_is_ours = False  # the library is device code launched by kloop (a Triton bundle)

    # -- wire ------------------------------------------------------------------------------------
    def recv(self):
        head = _read_exact(self.cmd, 4)
        if head is None:
            return None
        (n,) = struct.unpack("<I", head)
        return pickle.loads(_read_exact(self.cmd, n))

    def send(self, obj: dict) -> None:
        data = (json.dumps(obj, allow_nan=True) + "\n").encode()
        while data:
            data = data[os.write(self.reply_fd, data):]

    # -- requests ----------------------------------------------------------------------------------
    def prepare(self, spec_path: str, device: str) -> dict:
        """Everything before the library: the device (CUDA context, no persisting L2), the trusted spec,
        then the seccomp lockdown. A pre-started runner (tools/judge_handle.JudgeStandby) does this and
        waits; the library it will load is named only at decision time."""
        if self.spec is not None:
            raise RuntimeError("this runner is already prepared")
        self.device = torch.device(device)
        if self.device.type == "cuda":
            torch.cuda.set_device(0)
            torch.cuda.init()
            self.stream = torch.cuda.current_stream().cuda_stream
            _no_persisting_l2()  # before the library loads; it cannot raise the limit (cudaDeviceSetLimit: audit)
            _driver_in_global_scope()
        else:
            torch.set_num_threads(1)
        self.spec = load_spec(spec_path)
        harden_process()  # not dumpable, no capabilities: the other runner and the judge stay out of reach
        kept = threads_with_capabilities()
        if kept:
            raise RuntimeError(f"runner threads kept capabilities after dropping them: {'; '.join(kept)}")
        _lockdown(self.device.type == "cuda")
        return {}

    def load(self, lib_path: str, spec_path: str | None = None, device: str | None = None) -> dict:
        """Load THE library of this runner (once: a runner never holds a second one)."""
        if self.lib is not None:
            raise RuntimeError("this runner already loaded a library (runners are single-use)")
        if self.spec is None:
            self.prepare(spec_path, device)
        # the untrusted library loads only now (its static constructors run here). A Triton task's is a
        # bundle of cubins, loaded through the CUDA driver (tools/triton_launch.py): device code only
        if lib_path.endswith(".triton.json"):
            self.lib = TritonModule(os.path.realpath(lib_path), self.device)
            self.launch_is_ours = True
        else:
            self.lib = ctypes.CDLL(os.path.realpath(lib_path), mode=ctypes.RTLD_LOCAL)
        self.spec.setup(self.lib)
        return {}

    def bind(self, key, dims: dict, inputs: dict, outputs: dict, writable_inputs: bool = False) -> dict:
        """Map the buffers. `writable_inputs` (fault diagnosis only): inputs copy-on-write, so a write
        lands in pages private to this process, which the judge sees in /proc/<pid>/smaps."""
        wanted = sum(1 for d in (*inputs.values(), *outputs.values()) if d[0] in ("vmm", "fd"))
        fds = self._receive_fds(wanted)
        try:
            self.sets[key] = (dims, {k: self._tensor(v, "private" if writable_inputs else False, fds) for k, v in inputs.items()},
                              {k: self._tensor(v, True, fds) for k, v in outputs.items()})
        finally:
            for fd in fds:  # imported ones are closed already; none stays open for the library to find
                if fd is not None:
                    try:
                        os.close(fd)
                    except OSError:
                        pass
        return {}

    def _receive_fds(self, n: int) -> list:
        if n == 0:
            return []
        if self.fd_sock is None:
            raise RuntimeError("device buffers sent to a runner without a descriptor socket")
        _, fds, _, _ = socket.recv_fds(self.fd_sock, 16, n)
        if len(fds) != n:
            for fd in fds:
                os.close(fd)
            raise RuntimeError(f"expected {n} buffer descriptors, received {len(fds)}")
        return list(fds)

    def _tensor(self, desc, writable: bool, fds: list = ()):
        kind = desc[0]
        if kind == "value":
            return desc[1]
        if kind == "vmm":  # a device buffer of the judge's (tools/vmm.py): read-only unless an output
            from tools import vmm

            _, index, size, dtype, shape = desc
            fd, fds[index] = fds[index], None
            buf = vmm.ImportedBuffer(fd, size, self.device.index or 0, writable=writable is True)
            return vmm.as_tensor(buf, _DTYPES[dtype], shape)
        if kind == "empty":
            return torch.empty(desc[2], dtype=_DTYPES[desc[1]], device=self.device)
        if kind != "fd":
            raise ValueError(f"unknown buffer description {kind!r}")
        # a shared-memory file the judge allocated, by descriptor (it has no name any more): inputs come
        # read-only and are mapped PROT_READ, so neither a write nor an mprotect can change them
        _, index, dtype, shape, nbytes = desc
        fd, fds[index] = fds[index], None
        try:
            mm = mmap.mmap(fd, nbytes, flags=mmap.MAP_PRIVATE if writable == "private" else mmap.MAP_SHARED,
                           prot=mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0))
        finally:
            os.close(fd)
        self.maps.append(mm)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "the given buffer is not writable": that is the point
            t = torch.frombuffer(mm, dtype=_DTYPES[dtype])
        return t.view(shape)

    def written_inputs(self, key) -> dict:
        """The inputs of `key` (bound with writable_inputs: copy-on-write) whose pages the calls wrote,
        from this process's own memory map (written pages turned anonymous)."""
        _, inputs, _ = self.sets[key]
        starts = {name: t.data_ptr() for name, t in inputs.items() if isinstance(t, torch.Tensor) and t.numel()}
        names, current = set(), []
        with open("/proc/self/smaps") as f:
            for line in f:
                head = line.split()
                if len(head) >= 5 and "-" in head[0] and not head[0].endswith(":"):
                    lo, hi = (int(x, 16) for x in head[0].split("-"))
                    current = [n for n, p in starts.items() if lo <= p < hi]
                elif current and head and head[0] == "Anonymous:" and int(head[1]) > 0:
                    names.update(current)
        return {"names": sorted(names)}

    def unbind(self, keys: list) -> dict:
        for k in keys:
            self.sets.pop(k, None)
        return {}

    def run(self, calls: list, samples: int = 1, timed: bool = False, spin: bool = False, snapshot=None,
            spin_calls: int | None = None) -> dict:
        """`samples` times: the calls in order; on CUDA each sample timed with events, after a spin that
        hides the host's enqueue (`spin`: timed samples, not probes). The L2 flush before a timed call is
        the judge's, from its own context (tools.remote): a runner has none to skip or shorten.
        `snapshot` (CUDA, one call): the key of a bound set whose outputs receive a copy of the call's
        outputs, made on the call's stream right after it (before the device sync), so the judge can see
        whether they changed once the call's stream had finished (work left on another stream).
        `spin_calls`: the spin covers the enqueue of this many calls, not all (long requests: the calls after the
        first few are enqueued while earlier ones run, and a spin that grew with the calls would be request time
        beside them that the judge's clock cannot tell from an under-report)."""
        times = []
        cuda = self.device.type == "cuda"
        if snapshot is not None and (not cuda or len(calls) != 1 or samples != 1):
            raise ValueError("a snapshot is taken of one CUDA call")
        for _ in range(samples):
            if cuda and timed:
                if spin:  # timed samples only: a probe's wall must not carry a spin
                    hold_device(min(len(calls), spin_calls or len(calls)), self.enqueue_per_call_s)
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
            enqueue_started = time.perf_counter()
            for key in calls:
                dims, inputs, outputs = self.sets[key]
                self.spec.launch(self.lib, dims, inputs, outputs, self.stream)
            if cuda and self.launch_is_ours:
                # the host's enqueue per call, for the next timed sample's spin: the slowest lately, decaying;
                # untimed runs (warm-ups, probes) count too, so a side's first timed sample is covered.
                # Only where that host code is ours (a Triton task's cubins, launched by tools/triton_launch):
                # a C/C++ entry point's host time is the candidate's and stays on the clock (0: the fixed spin)
                per_call = (time.perf_counter() - enqueue_started) / max(1, len(calls))
                self.enqueue_per_call_s = max(per_call, 0.9 * self.enqueue_per_call_s)
            if cuda and timed:
                end.record()
                times.append((start, end))
        if snapshot is not None:
            # stream-ordered after the call (and its end event): what a user's next kernel on this stream reads
            _, _, outputs = self.sets[calls[0]]
            for name, dst in self.sets[snapshot][2].items():
                dst.copy_(outputs[name], non_blocking=True)
        out: dict = {}
        if cuda:
            torch.cuda.synchronize()  # every stream of this context idle before the answer
            if times:
                # on the device's clock: from the last timed call's end event on this stream until every
                # stream of the context was idle (and the host saw it). Work left on another stream shows
                # here whole, like for like with the best's (its own host wake-up is the same); the gate
                # bounds the difference by the best's measured spread (`Gate.trail_allowance`)
                idle = torch.cuda.Event(enable_timing=True)
                idle.record()
                idle.synchronize()
                out["trailing"] = [times[-1][1].elapsed_time(idle) * 1e-3]
        return {"times": [s.elapsed_time(e) * 1e-3 for s, e in times], **out}

    def serve(self) -> None:
        while True:
            msg = self.recv()
            if msg is None:
                return
            nonce, op, kw = msg
            if op == "exit":
                self.send({"nonce": nonce, "ok": True})
                return
            try:
                out = getattr(self, op)(**kw)
                self.send({"nonce": nonce, "ok": True, **out})
            except Exception as exc:
                self.send({"nonce": nonce, "ok": False, "error": f"{type(exc).__name__}: {exc}"[:2000],
                           "where": traceback.format_exc(limit=3)[-800:]})


def _no_persisting_l2() -> None:
    """No L2 set aside for persisting accesses (cudaLimitPersistingL2CacheSize = 0): an access policy
    window a kernel passes as a launch attribute (cudaLaunchKernelEx is allowed) has nothing to persist in."""
    rt = cudart()
    if rt is not None:
        rt.cudaDeviceSetLimit(CUDA_LIMIT_PERSISTING_L2_CACHE_SIZE, 0)


def _driver_in_global_scope() -> bool:
    """The CUDA driver torch loaded, promoted to the global symbol scope (RTLD_NOLOAD: never a second
    copy), so a library's imports of the driver's TMA encoders (the only driver symbols the audit
    allows) resolve at load. The library is linked without -lcuda (CI has no driver to link against)."""
    try:
        ctypes.CDLL("libcuda.so.1", mode=os.RTLD_GLOBAL | os.RTLD_NOLOAD)
        return True
    except OSError:
        return False


def _lockdown(cuda: bool = False) -> None:
    """SANDBOX CALL SITE: the seccomp filter of tools/sandbox.py (no exec/fork/ptrace/sockets/...),
    installed after torch and the spec are imported and before the untrusted library loads, when the
    judge asks for it (KLOOP_LOCKDOWN=1 in this process's environment)."""
    from tools.sandbox import lockdown, lockdown_requested

    if lockdown_requested():
        # the CUDA driver's IPC may use unix sockets; a CPU runner's CPUs are the judge's to choose (tools/placement.py)
        lockdown(allow_unix_sockets=cuda, own_placement=cuda)


def _read_exact(f, n: int):
    buf = b""
    while len(buf) < n:
        chunk = f.read(n - len(buf))
        if not chunk:
            return None
        buf += chunk
    return buf


def main(argv: list[str]) -> int:
    if len(argv) not in (3, 4):
        print("usage: python -m tools.libhost CMD_FD REPLY_FD [FD_SOCKET]", file=sys.stderr)
        return 2
    Host(int(argv[1]), int(argv[2]), int(argv[3]) if len(argv) == 4 else None).serve()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
