"""Quick GPU check + timing of paged_decode v5 (tensor cores) against v4 (the accepted kernel).

    python3 runs/showcase/paged_decode/exploration/devbench5.py .        (from the repo root)

Builds every variant in parallel (nvcc, ptxas -v), then runs each variant in its own child process
(a launch fault or a hang in one variant cannot take the others down): check every shape of
task.toml against spec.reference with the manifest's tolerance (NaN-poisoned outputs), then time the
bench shapes (L2 flushed before every call, CUDA events, 40 calls, median), as devbench.py does. All
children draw the same inputs (same seed). Prints a final table. Not a gate decision.
"""
import ctypes, json, os, subprocess, sys, time, tomllib
from pathlib import Path

ROOT = Path(sys.argv[1]).resolve(); HERE = Path(__file__).resolve().parent
TASK = ROOT / "kernels/paged_decode"
BUILD = Path(os.environ.get("DEVBENCH5_BUILD", "/tmp/devbench5"))
V4_KNOBS = dict(THREADS=128, QHEADS_PER_BLOCK=4, VEC=8, PARTITION_SIZE=0)  # the accepted kernel's knobs (best.json)
VARIANTS = {
    "v4_t128": ("v4.cu", V4_KNOBS),
    "v5_s3w2": ("v5.cu", {**V4_KNOBS, "V5_STAGES": 3, "V5_WARPS": 2}),  # d128: 48 KB, 4 blocks = 8 warps / SM
    "v5_s4w1": ("v5.cu", {**V4_KNOBS, "V5_STAGES": 4, "V5_WARPS": 1}),  # d128: 32 KB, 6 blocks = 6 warps / SM
    "v5_s2w3": ("v5.cu", {**V4_KNOBS, "V5_STAGES": 2, "V5_WARPS": 3}),  # d128: 48 KB, 4 blocks = 12 warps / SM
    "v5_s3w2_fine": ("v5.cu", {**V4_KNOBS, "V5_STAGES": 3, "V5_WARPS": 2,  # split more: b128 too, ~8 waves
                               "V5_NOSPLIT_WAVES_X10": 30, "V5_SPLIT_WAVES": 8}),
}
CHILD_TIMEOUT_S = 90
SEED = 1234
REPS = 40


def build(name):
    src, defs = VARIANTS[name]
    out = BUILD / f"{name}.so"
    cmd = ["nvcc", "-gencode=arch=compute_90a,code=sm_90a", "-O3", "-std=c++17", "-Xcompiler=-fPIC", "-shared",
           "-Xptxas=-v", *[f"-D{k}={v}" for k, v in defs.items()], str(HERE / src), "-o", str(out)]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def ptxas_summary(log):
    """'kernel<D,split>: regs/spill-store bytes' for the attention kernels (the merge kernels left out)."""
    rows, cur, spill = [], None, None
    for line in log.splitlines():
        if "Compiling entry function" in line:
            cur = line.split("'")[1] if "'" in line else line
        elif "spill stores" in line:
            spill = line.split("bytes stack frame,")[1].split("bytes spill stores")[0].strip()
        elif "Used" in line and "registers" in line and cur:
            regs = line.split("Used")[1].split("registers")[0].strip()
            if "merge" not in cur:
                tag = cur.split("ILi")[1].split("E")[0] if "ILi" in cur else "?"
                split = "s" if "Lb1" in cur else "-"
                rows.append(f"d{tag}{split}:{regs}r/{spill}B")
            cur = None
    return " ".join(rows)


def child(name):
    """Check + time one variant; prints one JSON line (prefixed RESULT) with everything."""
    import torch
    sys.path.insert(0, str(ROOT))
    from tools.spec import load_spec
    man = tomllib.loads((TASK / "task.toml").read_text())
    spec = load_spec(TASK / "spec.py")
    tol = man["tolerance"]
    res = {"name": name, "check": "not run", "times": {}}
    try:
        lib = ctypes.CDLL(str(BUILD / f"{name}.so")); spec.setup(lib)
    except Exception as exc:
        res["check"] = f"LOAD FAILED {exc}"; print("RESULT " + json.dumps(res), flush=True); return
    dev = torch.device("cuda"); torch.cuda.set_device(0)
    gen = torch.Generator(device=dev); gen.manual_seed(SEED)
    stream = torch.cuda.current_stream().cuda_stream
    bad, worst = [], 0.0
    for sh in man["shapes"]:
        dims = sh["dims"]
        inp = spec.make_inputs(dims, gen, dev); outs = spec.make_outputs(dims, inp)
        for o in outs.values(): o.fill_(float("nan"))
        try:
            spec.launch(lib, dims, inp, outs, stream); torch.cuda.synchronize()
        except Exception as exc:
            bad.append(f"{sh['name']}: {exc}")
            if "illegal" in str(exc).lower() or "launch" in str(exc).lower(): break
            continue
        ref = spec.reference(dims, inp)
        for k, want in ref.items():
            got = outs[k].float(); want = want.float()
            err = (got - want).abs(); lim = tol["atol"] + tol["rtol"] * want.abs()
            nrel = ((got - want).norm() / want.norm().clamp_min(1e-30)).item()
            ratio = (err / lim).max().item() if torch.isfinite(got).all() else float("inf")
            worst = max(worst, ratio)
            if not torch.isfinite(got).all() or (err > lim).any() or nrel > tol["norm_rtol"]:
                bad.append(f"{sh['name']}: nonfinite={(~torch.isfinite(got)).sum().item()} "
                           f"mism={(err > lim).sum().item()} nrel={nrel:.2e}")
    res["check"] = "OK" if not bad else "FAIL " + "; ".join(bad[:4])
    res["worst_ratio"] = worst
    print(f"  {name}: check {res['check']} (worst err/bound {worst:.2f})", flush=True)
    if bad:
        print("RESULT " + json.dumps(res), flush=True); return
    flush = torch.empty(512 << 20, dtype=torch.uint8, device=dev)
    gen.manual_seed(SEED + 1)
    for sh in [s for s in man["shapes"] if s.get("bench")]:
        dims = sh["dims"]
        sets = [spec.make_inputs(dims, gen, dev) for _ in range(3)]
        outs = [spec.make_outputs(dims, i) for i in sets]
        ts = []
        try:
            for r in range(REPS):
                i = r % 3; flush.zero_()
                s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                s.record(); spec.launch(lib, dims, sets[i], outs[i], stream); e.record(); torch.cuda.synchronize()
                ts.append(s.elapsed_time(e) * 1e-3)
        except Exception as exc:
            res["times"][sh["name"]] = None; print(f"  {name}: {sh['name']} timing failed: {exc}"); break
        med = sorted(ts)[len(ts) // 2]
        res["times"][sh["name"]] = [med, spec.bytes_moved(dims) / med / 1e12]
        del sets, outs
    res["gpu"] = torch.cuda.get_device_name()
    print("RESULT " + json.dumps(res), flush=True)


def main():
    t_start = time.time()
    BUILD.mkdir(parents=True, exist_ok=True)
    only = sys.argv[2:] or list(VARIANTS)
    procs = {n: build(n) for n in only}
    regs, built = {}, []
    for n, p in procs.items():
        log = p.communicate()[0]
        if p.returncode:
            print(f"{n}: BUILD FAILED\n{log[-3000:]}"); regs[n] = "build failed"; continue
        regs[n] = ptxas_summary(log); built.append(n)
        print(f"{n}: built; ptxas {regs[n]}")
    print(f"builds: {time.time() - t_start:.1f} s", flush=True)
    results = {}
    for n in built:
        t0 = time.time()
        try:
            r = subprocess.run([sys.executable, __file__, str(ROOT), "--child", n], capture_output=True, text=True,
                               timeout=CHILD_TIMEOUT_S)
            out = r.stdout + r.stderr
            line = [l for l in out.splitlines() if l.startswith("RESULT ")]
            for l in out.splitlines():
                if not l.startswith("RESULT "): print(l)
            results[n] = json.loads(line[-1][7:]) if line else {"check": f"CHILD DIED rc={r.returncode}: {out[-800:]}"}
        except subprocess.TimeoutExpired:
            results[n] = {"check": f"TIMEOUT after {CHILD_TIMEOUT_S} s (hang?)"}
        print(f"{n}: {time.time() - t0:.1f} s", flush=True)
    # final table
    benches = ["b1_ctx32k", "b16_ctx4k", "b64_ctx8k_ramp", "b128_ctx2k", "b256_ctx1k"]
    print("\n" + f"{'variant':14s} {'check':6s}" + "".join(f"{b:>19s}" for b in benches))
    for n in only:
        r = results.get(n, {"check": regs.get(n, "not built")})
        ok = r.get("check") == "OK"
        row = f"{n:14s} {'OK' if ok else 'FAIL':6s}"
        for b in benches:
            t = r.get("times", {}).get(b)
            row += f"{t[0] * 1e6:9.1f}us {t[1]:4.2f}TB" if t else f"{'-':>19s}"
        print(row)
        if not ok: print(f"{'':14s} {str(r.get('check'))[:300]}")
    print("ptxas (regs/spill-store bytes):")
    for n in only: print(f"  {n}: {regs.get(n)}")
    gpus = {r.get("gpu") for r in results.values() if r.get("gpu")}
    print(f"GPU {', '.join(sorted(gpus)) or '?'}; total {time.time() - t_start:.1f} s")
    if os.environ.get("DEVBENCH_JSON"):  # every variant's defines, check and times, for pick_winner.py
        Path(os.environ["DEVBENCH_JSON"]).write_text(json.dumps(
            {"variants": {n: {"source": VARIANTS[n][0], "defines": VARIANTS[n][1], "regs": regs.get(n),
                              **results.get(n, {})} for n in only}, "bench": benches}, indent=1))


if __name__ == "__main__":
    if len(sys.argv) >= 4 and sys.argv[2] == "--child":
        child(sys.argv[3])
    else:
        main()
