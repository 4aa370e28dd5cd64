# Per-process offsets: two fresh worker processes running the same kernel (same .so, same values), both pinned to
# one CPU before each pair, in random order; per trial, the ratio of their mean CPU times with a 95% interval.
# If trials' ratios spread more than their intervals allow, processes differ by more than noise.
import math, os, random, statistics, subprocess, sys, time
LIB, TRIALS, PAIRS, CALLS = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), 4
WORKER = r'''
import ctypes, sys, time, numpy as np
lib = ctypes.CDLL(sys.argv[1]); n = 192
lib.kloop_matmul.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int] * 3
rng = np.random.default_rng(0)
if len(sys.argv) > 2:  # inputs shared: one file mapped by both processes (the gate's inputs: same physical pages)
    m = np.memmap(sys.argv[2], dtype=np.float32, mode="r", shape=(2, n, n)); a, b = m[0], m[1]
else:
    a = rng.standard_normal((n, n), dtype=np.float32); b = rng.standard_normal((n, n), dtype=np.float32)
c = np.zeros((n, n), np.float32)
for line in sys.stdin:
    t = time.process_time_ns()
    for _ in range(int(line)): lib.kloop_matmul(a.ctypes.data, b.ctypes.data, c.ctypes.data, n, n, n)
    print(time.process_time_ns() - t, flush=True)
'''
import ctypes, numpy as np
SHARED = None
if os.environ.get("SHARED"):
    SHARED = "/dev/shm/procoff_inputs"
    np.random.default_rng(0).standard_normal((2, 192, 192), dtype=np.float32).tofile(SHARED)
getcpu = ctypes.CDLL(None).sched_getcpu
out = []
for trial in range(TRIALS):
    extra = [SHARED] if SHARED else []
    libs = [LIB, LIB]
    if os.environ.get("TWO_FILES"):  # each process its own copy of the library file (own page-cache pages)
        import shutil
        libs = [f"/dev/shm/procoff_lib{trial}_{i}.so" for i in range(2)]
        for dst in libs: shutil.copyfile(LIB, dst)
    ps = [subprocess.Popen([sys.executable, "-c", WORKER, libs[i], *extra], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True) for i in range(2)]
    def run(p):
        p.stdin.write(f"{CALLS}\n"); p.stdin.flush(); return int(p.stdout.readline())
    for p in ps: run(p)  # warm
    logs = []
    for _ in range(PAIRS):
        cpu = getcpu()
        for p in ps: os.sched_setaffinity(p.pid, {cpu})
        order = [0, 1] if random.random() < 0.5 else [1, 0]
        t = [0, 0]
        for i in order: t[i] = run(ps[i])
        logs.append(math.log(t[1] / t[0]))
    for p in ps: p.stdin.close(); p.wait()
    m = statistics.mean(logs); h = 1.96 * statistics.stdev(logs) / math.sqrt(len(logs))
    out.append((m, h)); print(f"trial {trial}: x{math.exp(m):.4f} [{math.exp(m - h):.4f}, {math.exp(m + h):.4f}]", flush=True)
ms = [m for m, _ in out]; hs = [h for _, h in out]
print(f"spread of trial log-ratios (sd) {statistics.stdev(ms):.4f} vs mean within-trial 95% half-width/1.96 {statistics.mean(hs) / 1.96:.4f}; "
      f"trials whose interval excludes 1: {sum(abs(m) > h for m, h in out)} of {len(out)}")
