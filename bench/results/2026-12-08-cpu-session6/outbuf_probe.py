# Does the output buffer's physical placement change a CPU kernel's speed? One process, one input pair,
# N output buffers (each its own mmap: its own physical pages), timed in turn, CPU time per call.
import ctypes, mmap, os, random, statistics, sys, time
import numpy as np
lib = ctypes.CDLL(sys.argv[1]); n = 192; N = int(sys.argv[2]) if len(sys.argv) > 2 else 12
lib.kloop_matmul.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int] * 3
os.sched_setaffinity(0, {int(sys.argv[3]) if len(sys.argv) > 3 else 0})
def buf():
    m = mmap.mmap(-1, n * n * 4); a = np.frombuffer(m, dtype=np.float32); a[:] = 0; return m, a
rng = np.random.default_rng(0)
A = buf(); B = buf(); A[1][:] = rng.standard_normal(n * n); B[1][:] = rng.standard_normal(n * n)
outs = [buf() for _ in range(N)]
ptr = lambda x: x[1].ctypes.data
ts = {i: [] for i in range(N)}
for r in range(int(os.environ.get("ROUNDS", 60))):
    order = list(range(N)); random.shuffle(order)
    for i in order:
        t = time.thread_time_ns(); lib.kloop_matmul(ptr(A), ptr(B), ptr(outs[i]), n, n, n); ts[i].append(time.thread_time_ns() - t)
med = [statistics.median(ts[i][10:]) / 1e6 for i in range(N)]
m0 = statistics.median(med)
print("per-buffer median ms / overall:", " ".join(f"{x / m0:.3f}" for x in med), f"(overall {m0:.3f} ms)")
# the same buffer's two halves of the run: how stable a per-buffer figure is
h1 = [statistics.median(ts[i][10:len(ts[i])//2+5]) for i in range(N)]; h2 = [statistics.median(ts[i][len(ts[i])//2+5:]) for i in range(N)]
print("half-run correlation:", np.corrcoef(h1, h2)[0, 1].round(3), "spread (max/min) per-buffer:", round(max(med) / min(med), 3))
