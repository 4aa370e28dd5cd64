"""Quick GPU check + timing of paged_decode variants (dogfood prep, not a gate decision)."""
import ctypes, subprocess, sys, tomllib, time, os
from pathlib import Path
import torch
ROOT = Path(sys.argv[1]); HERE = Path(__file__).parent
sys.path.insert(0, str(ROOT))
from tools.spec import load_spec
task = ROOT / "kernels/paged_decode"
man = tomllib.loads((task / "task.toml").read_text())
spec = load_spec(task / "spec.py")
shapes = man["shapes"]
def build(src, defs, name):
    out = f"/tmp/{name}.so"
    cmd = ["nvcc", "-gencode=arch=compute_90a,code=sm_90a", "-O3", "-std=c++17", "-Xcompiler=-fPIC", "-shared", "-Xptxas=-v",
           *[f"-D{k}={v}" for k, v in defs.items()], str(src), "-o", out]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode: print(name, "BUILD FAILED", r.stderr[-2000:]); return None
    regs = [l.split("Used")[1].split(",")[0].strip() for l in r.stderr.splitlines() if "Used" in l and "registers" in l]
    print(f"{name}: regs {regs}")
    lib = ctypes.CDLL(out); spec.setup(lib); return lib
dev = torch.device("cuda"); torch.cuda.set_device(0)
gen = torch.Generator(device=dev); gen.manual_seed(1234)
flush = torch.empty(512 << 20, dtype=torch.uint8, device=dev)
variants = {"orig_tuned": (task / "paged_decode.cu", dict(THREADS=64, QHEADS_PER_BLOCK=2, VEC=8, PARTITION_SIZE=256))}
for th in (64, 128, 256):
    variants[f"v4_t{th}"] = (HERE / "v4.cu", dict(THREADS=th, QHEADS_PER_BLOCK=4, VEC=8, PARTITION_SIZE=0))
variants["v4_t128_q8"] = (HERE / "v4.cu", dict(THREADS=128, QHEADS_PER_BLOCK=8, VEC=8, PARTITION_SIZE=0))
variants["v4_t256_k4"] = (HERE / "v4.cu", dict(THREADS=256, QHEADS_PER_BLOCK=4, VEC=8, PARTITION_SIZE=0, KTILE=4))
libs = {n: build(s, d, n) for n, (s, d) in variants.items()}
stream = torch.cuda.current_stream().cuda_stream
tol = man["tolerance"]
checks = {}
for name, lib in libs.items():
    if lib is None: continue
    bad = []
    for sh in shapes:
        dims = sh["dims"]
        inp = spec.make_inputs(dims, gen, dev); outs = spec.make_outputs(dims, inp)
        for o in outs.values(): o.fill_(float("nan"))
        try:
            spec.launch(lib, dims, inp, outs, stream); torch.cuda.synchronize()
        except Exception as exc:
            bad.append(f"{sh['name']}: {exc}"); continue
        ref = spec.reference(dims, inp)
        for k, want in ref.items():
            got = outs[k].float(); want = want.float()
            err = (got - want).abs(); lim = tol["atol"] + tol["rtol"] * want.abs()
            nrel = ((got - want).norm() / want.norm().clamp_min(1e-30)).item()
            if not torch.isfinite(got).all() or (err > lim).any() or nrel > tol["norm_rtol"]:
                bad.append(f"{sh['name']}: nonfinite={(~torch.isfinite(got)).sum().item()} mism={(err>lim).sum().item()} nrel={nrel:.2e}")
    checks[name] = f"check {'OK' if not bad else 'FAIL ' + '; '.join(bad[:4])}"
    print(f"{name}: {checks[name]}")
print(f"{'shape':18s}" + "".join(f"{n:>16s}" for n in libs))
for sh in [s for s in shapes if s.get("bench")]:
    dims = sh["dims"]; nb = spec.bytes_moved(dims)
    sets = [spec.make_inputs(dims, gen, dev) for _ in range(3)]
    outs = [spec.make_outputs(dims, i) for i in sets]
    row = f"{sh['name']:18s}"
    for name, lib in libs.items():
        if lib is None: row += f"{'-':>16s}"; continue
        ts = []
        if "FAIL" in checks.get(name, ""): row += f"{'fail':>16s}"; continue
        for r in range(40):
            i = r % 3; flush.zero_()
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record(); spec.launch(lib, dims, sets[i], outs[i], stream); e.record(); torch.cuda.synchronize()
            ts.append(s.elapsed_time(e) * 1e-3)
        med = sorted(ts)[len(ts)//2]
        row += f"{med*1e6:8.1f}us {nb/med/1e12:4.2f}TB"
    print(row)
print(torch.cuda.get_device_name(), torch.version.cuda)
