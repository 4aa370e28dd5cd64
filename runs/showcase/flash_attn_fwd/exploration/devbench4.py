"""flash_attn_fwd variants on the H200, v4 edition (TMA kernels): build every variant (parallel nvcc),
check every check shape of task.toml plus a few multi-tile extras (manifest tolerances, outputs
poisoned with NaN first) in parallel child processes under a timeout (a deadlocked kernel cannot eat
the call, a failing variant does not stop the others), then time the gated bench shapes for every
variant that passed and the torch SDPA comparators in ONE child, interleaved per shape (L2 flush,
CUDA events, median), and cross-check each variant's O on the bench shapes against sdpa_cudnn's.

Differences from devbench.py: the TMA kernels import cuTensorMapEncodeTiled from the driver, so
each child promotes libcuda.so.1 to the global symbol scope before loading a library (as the
harness does, tools/libhost.py); checks run in parallel; timing runs in one process; results are
written as they come (a timeout keeps what was done).

usage (repo root): python3 runs/showcase/flash_attn_fwd/exploration/devbench4.py ROOT OUTDIR [variant ...]
variants: variants4.json beside this file, {name: [source, {define: value}]}."""
import ctypes, json, os, subprocess, sys, time, tomllib
from pathlib import Path

HERE = Path(__file__).resolve().parent
VARIANTS = {k: tuple(v) for k, v in json.loads((HERE / "variants4.json").read_text()).items()}
COMPARATORS = ["sdpa_flash", "sdpa_cudnn"]
CHECK_TIMEOUT = int(os.environ.get("DB4_CHECK_TIMEOUT", 60))
TIME_TIMEOUT = int(os.environ.get("DB4_TIME_TIMEOUT", 70))
REPS = int(os.environ.get("DB4_REPS", 10))
EXTRA = [  # multi-tile, stage wrap-around, tails off every tile size (128, 176, 192)
    {"name": "x_d128_s1k", "dims": dict(batch=2, heads=4, seqlen=1024, head_dim=128, causal=False)},
    {"name": "x_d128_s1k_causal", "dims": dict(batch=2, heads=4, seqlen=1024, head_dim=128, causal=True)},
    {"name": "x_d128_s2000", "dims": dict(batch=1, heads=3, seqlen=2000, head_dim=128, causal=False)},
    {"name": "x_d64_s2k_causal", "dims": dict(batch=1, heads=4, seqlen=2048, head_dim=64, causal=True)},
    {"name": "x_d64_s1999", "dims": dict(batch=2, heads=2, seqlen=1999, head_dim=64, causal=False)},
]


def build(root, name, src, defs):
    path = HERE / src if (HERE / src).exists() else root / src
    out = f"/tmp/fa4_{name}.so"
    cmd = ["nvcc", "-gencode=arch=compute_90a,code=sm_90a", "-O3", "-std=c++17", "-Xcompiler=-fPIC", "-shared",
           "-Xptxas=-v", *[f"-D{k}={v}" for k, v in {"BLOCK_M": 64, "BLOCK_N": 64, "NUM_WARPS": 8, "STAGES": 2, **defs}.items()],
           str(path), "-o", out]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True), out


def _setup(root):
    import torch
    sys.path.insert(0, str(root))
    from tools.spec import load_spec
    task = root / "kernels/flash_attn_fwd"
    man = tomllib.loads((task / "task.toml").read_text())
    spec = load_spec(task / "spec.py")
    dev = torch.device("cuda")
    torch.cuda.init()
    torch.zeros(1, device=dev)
    try:  # the driver torch loaded, into the global scope: the libraries import cuTensorMapEncodeTiled
        ctypes.CDLL("libcuda.so.1", mode=os.RTLD_GLOBAL | os.RTLD_NOLOAD)
    except OSError:
        ctypes.CDLL("libcuda.so.1", mode=os.RTLD_GLOBAL)
    return torch, man, spec, dev


def _runner(spec, name, so, stream):
    if name in COMPARATORS:
        return spec.comparators[name]
    lib = ctypes.CDLL(so)
    spec.setup(lib)
    return lambda dims, inp, outs: spec.launch(lib, dims, inp, outs, stream)


def child_check(root, name, so, outdir):
    torch, man, spec, dev = _setup(root)
    gen = torch.Generator(device=dev); gen.manual_seed(4321)
    stream = torch.cuda.current_stream().cuda_stream
    res = {"name": name, "checks": {}}
    lib = ctypes.CDLL(so)
    res["err_hd96"] = lib.kloop_flash_attn_fwd(None, None, None, None, None, 1, 1, 16, 96, 0, ctypes.c_float(0.1), None)
    run = _runner(spec, name, so, stream)
    ok = True
    for sh in [s for s in man["shapes"] if s.get("check", True)] + EXTRA:
        dims = sh["dims"]
        inp = spec.make_inputs(dims, gen, dev); outs = spec.make_outputs(dims, inp)
        for t in outs.values(): t.fill_(float("nan"))
        try:
            run(dims, inp, outs); torch.cuda.synchronize()
        except Exception as exc:
            res["checks"][sh["name"]] = f"ERROR {exc}"; ok = False
            if "illegal" in str(exc) or "launch" in str(exc).lower():
                break  # a sticky CUDA error: nothing after it can run in this process
            continue
        ref = spec.reference(dims, inp)
        msgs = []
        for key, want in ref.items():
            tol = man.get("tolerance_for", {}).get(key, man["tolerance"])
            got = outs[key].float(); want = want.float()
            err = (got - want).abs(); lim = tol["atol"] + tol["rtol"] * want.abs()
            nrel = ((got - want).nan_to_num(1e9).norm() / want.norm().clamp_min(1e-30)).item()
            nonfin = (~torch.isfinite(got)).sum().item(); mism = (err > lim).sum().item()
            good = nonfin == 0 and mism == 0 and nrel <= tol["norm_rtol"]
            ok &= good
            msgs.append(f"{key}:{'ok' if good else 'BAD'} nrel={nrel:.1e} maxabs={err.nan_to_num(1e9).max().item():.1e}"
                        + ("" if good else f" nonfinite={nonfin} mism={mism}"))
            if not good and mism:
                msgs.append(f"first bad idx {(err > lim).nonzero()[:3].tolist()}")
        res["checks"][sh["name"]] = " ".join(msgs)
        (Path(outdir) / f"{name}.check.json").write_text(json.dumps(res, indent=1))
    res["check_ok"] = ok and res["err_hd96"] == 1
    (Path(outdir) / f"{name}.check.json").write_text(json.dumps(res, indent=1))
    print(json.dumps(res))


def child_time(root, names_sos, outdir):
    torch, man, spec, dev = _setup(root)
    gen = torch.Generator(device=dev); gen.manual_seed(1234)
    stream = torch.cuda.current_stream().cuda_stream
    runs = {n: _runner(spec, n, so, stream) for n, so in names_sos}
    flush = torch.empty(256 << 20, dtype=torch.uint8, device=dev)
    res = {n: {} for n in runs}
    path = Path(outdir) / "timing.json"
    order = [s for s in man["shapes"] if s.get("bench")]
    order.sort(key=lambda s: s["dims"]["seqlen"])  # short shapes first: a timeout keeps the most shapes
    for sh in order:
        dims = sh["dims"]
        sets = [spec.make_inputs(dims, gen, dev) for _ in range(2)]
        outs = {n: [spec.make_outputs(dims, i) for i in sets] for n in runs}
        for n, run in runs.items():  # warm-up (cuDNN plans, first launch)
            try:
                run(dims, sets[0], outs[n][0]); torch.cuda.synchronize()
            except Exception as exc:
                res[n][sh["name"]] = {"error": str(exc)[:300]}
        live = [n for n in runs if "error" not in res[n].get(sh["name"], {})]
        ts = {n: [] for n in live}
        for r in range(REPS):  # interleaved: the variants see the same clocks
            for n in live:
                i = r % 2; flush.zero_()
                s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                s.record(); runs[n](dims, sets[i], outs[n][i]); e.record(); torch.cuda.synchronize()
                ts[n].append(s.elapsed_time(e) * 1e-3)
        ref_o = outs["sdpa_cudnn"][1]["o"].float() if "sdpa_cudnn" in live else None
        for n in live:
            med = sorted(ts[n])[len(ts[n]) // 2]
            entry = {"ms": med * 1e3, "tflops": spec.flops(dims) / med / 1e12}
            if ref_o is not None and n not in COMPARATORS:  # same inputs (set 1, the last rep used it too)
                got = outs[n][1]["o"].float()
                entry["vs_cudnn_nrel"] = ((got - ref_o).nan_to_num(1e9).norm() / ref_o.norm()).item()
                lse = outs[n][1]["lse"]
                entry["lse_finite"] = bool(torch.isfinite(lse).all().item())
            res[n][sh["name"]] = entry
        del sets, outs, ref_o
        path.write_text(json.dumps(res, indent=1))
        print(sh["name"], {n: round(res[n][sh["name"]].get("tflops", -1), 1) for n in runs}, flush=True)
    path.write_text(json.dumps(res, indent=1))


def main():
    root, outdir = Path(sys.argv[1]).resolve(), Path(sys.argv[2])
    outdir.mkdir(parents=True, exist_ok=True)
    names = [n for n in (sys.argv[3:] or list(VARIANTS)) if n in VARIANTS]
    t0 = time.time()
    procs = {n: build(root, n, *VARIANTS[n]) for n in names}
    sos, results = {}, {}
    for n, (p, so) in procs.items():
        log = p.communicate()[0]
        (outdir / f"{n}.build.txt").write_text(log)
        keep = [l.strip() for l in log.splitlines()
                if "registers" in l or "spill" in l or "Compiling entry" in l or "C75" in l or "error" in l]
        results[n] = {"build_rc": p.returncode, "ptxas": keep}
        if p.returncode == 0: sos[n] = so
        else: print(n, "BUILD FAILED", log[-1500:])
    print(f"built in {time.time() - t0:.0f}s", flush=True)
    # checks, all variants at once (correctness only: GPU sharing does not matter)
    t1 = time.time()
    kids = {n: subprocess.Popen([sys.executable, __file__, "--check", str(root), n, so, str(outdir)],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for n, so in sos.items()}
    for n, p in kids.items():
        try:
            out, err = p.communicate(timeout=max(5, CHECK_TIMEOUT - (time.time() - t1)))
            (outdir / f"{n}.check.log").write_text(out + err)
            line = [l for l in out.splitlines() if l.startswith("{")]
            results[n].update(json.loads(line[-1]) if line else {"error": err[-800:]})
        except subprocess.TimeoutExpired:
            p.kill(); p.communicate()
            part = outdir / f"{n}.check.json"
            if part.exists(): results[n].update(json.loads(part.read_text()))
            results[n]["check_ok"] = False
            results[n]["error"] = "TIMEOUT in checks (hang?)"
    print(f"checked in {time.time() - t1:.0f}s", flush=True)
    (outdir / "results.json").write_text(json.dumps(results, indent=1))
    # timing: every passing variant and the comparators in one process
    t2 = time.time()
    timed = [(n, sos[n]) for n in sos if results[n].get("check_ok")] + [(c, "") for c in COMPARATORS]
    args = [x for pair in timed for x in pair]
    try:
        r = subprocess.run([sys.executable, __file__, "--time", str(root), str(outdir), *args],
                           capture_output=True, text=True, timeout=TIME_TIMEOUT)
        (outdir / "timing.log").write_text(r.stdout + r.stderr)
        if r.returncode: print("timing child failed:", r.stderr[-1500:])
    except subprocess.TimeoutExpired:
        print("timing TIMEOUT: partial results")
    tpath = outdir / "timing.json"
    if tpath.exists():
        for n, b in json.loads(tpath.read_text()).items():
            results.setdefault(n, {})["bench"] = b
    print(f"timed in {time.time() - t2:.0f}s", flush=True)
    (outdir / "results.json").write_text(json.dumps(results, indent=1))
    # summary
    for n, r in results.items():
        if n in COMPARATORS: continue
        regs = [l for l in r.get("ptxas", []) if "registers" in l or "spill" in l or "C75" in l]
        print(f"== {n}: build_rc={r.get('build_rc')} err_hd96={r.get('err_hd96')} check_ok={r.get('check_ok')} {r.get('error', '')}")
        for l in regs: print("   ", l)
        for s, m in r.get("checks", {}).items():
            if "BAD" in m or "ERROR" in m or s.startswith("x_") or s in ("d128_s1_causal", "d64_s17"):
                print(f"   {s}: {m}")
    bench_names = sorted({s for r in results.values() for s in r.get("bench", {})})
    cols = [n for n in results if results[n].get("bench")]
    print(f"{'TFLOP/s':18s}" + "".join(f"{n[:16]:>17s}" for n in cols))
    for s in bench_names:
        row = f"{s:18s}"
        for n in cols:
            e = results[n]["bench"].get(s, {})
            row += f"{e['tflops']:10.1f}" + (f" ({e['vs_cudnn_nrel']:.0e})" if "vs_cudnn_nrel" in e else " " * 7) \
                if "tflops" in e else f"{'-':>17s}"
        print(row)
    print("(in parentheses: norm-relative difference of O against sdpa_cudnn on the same inputs)")
    try:
        import torch
        print(torch.cuda.get_device_name(), "torch", torch.__version__, "cuda", torch.version.cuda)
    except Exception:
        pass
    print(subprocess.run(["nvcc", "--version"], capture_output=True, text=True).stdout.splitlines()[-1])
    print(subprocess.run(["nvidia-smi", "--query-gpu=driver_version,clocks.sm,clocks.max.sm", "--format=csv,noheader"],
                         capture_output=True, text=True).stdout)
    print(f"total {time.time() - t0:.0f}s")


if __name__ == "__main__":
    if sys.argv[1] == "--check":
        child_check(Path(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5])
    elif sys.argv[1] == "--time":
        rest = sys.argv[4:]
        child_time(Path(sys.argv[2]), list(zip(rest[0::2], rest[1::2])), sys.argv[3])
    else:
        main()
