"""flash_attn_fwd variants on the H200: build, check every check shape (manifest tolerances), time the
gated bench shapes (L2-flushed CUDA events, median), torch SDPA comparators in the same run.
Each variant runs in its own child process under a timeout (a deadlocked wgmma kernel cannot eat the call).
usage: python3 devbench.py ROOT OUTDIR [variant ...]"""
import ctypes, json, os, subprocess, sys, time, tomllib
from pathlib import Path

HERE = Path(__file__).resolve().parent
VARIANTS = {  # name: (source relative to HERE or ROOT, defines)
    "v1_bn128": ("fa_wgmma_v1.cu", {"BLOCK_N": 128}),
    "v1_bn64": ("fa_wgmma_v1.cu", {"BLOCK_N": 64}),
}
EXTRA_VARIANTS = HERE / "variants.json"
if EXTRA_VARIANTS.exists():
    VARIANTS = {k: tuple(v) for k, v in json.loads(EXTRA_VARIANTS.read_text()).items()}


def build(root, name, src, defs):
    path = HERE / src if (HERE / src).exists() else root / src
    out = f"/tmp/fa_{name}.so"
    cmd = ["nvcc", "-gencode=arch=compute_90a,code=sm_90a", "-O3", "-std=c++17", "-Xcompiler=-fPIC", "-shared",
           "-Xptxas=-v", *[f"-D{k}={v}" for k, v in {"BLOCK_M": 64, "NUM_WARPS": 8, "STAGES": 2, **defs}.items()], str(path), "-o", out]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True), out


def child(root, name, so, outdir):
    import torch
    sys.path.insert(0, str(root))
    from tools.spec import load_spec
    task = root / "kernels/flash_attn_fwd"
    man = tomllib.loads((task / "task.toml").read_text())
    spec = load_spec(task / "spec.py")
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev); gen.manual_seed(4321)
    stream = torch.cuda.current_stream().cuda_stream
    res = {"name": name, "checks": {}, "bench": {}}
    comparator = name.startswith("sdpa_")
    if comparator:
        run = spec.comparators[name]
    else:
        lib = ctypes.CDLL(so); spec.setup(lib)
        run = lambda dims, inp, outs: spec.launch(lib, dims, inp, outs, stream)
        # error path: head_dim 96 must return 1 with nothing launched
        st = lib.kloop_flash_attn_fwd(None, None, None, None, None, 1, 1, 16, 96, 0, ctypes.c_float(0.1), None)
        res["err_hd96"] = st
    extra = [{"name": "x_d128_s1k", "dims": dict(batch=2, heads=4, seqlen=1024, head_dim=128, causal=False)},
             {"name": "x_d128_s1k_causal", "dims": dict(batch=2, heads=4, seqlen=1024, head_dim=128, causal=True)},
             {"name": "x_d64_s2k_causal", "dims": dict(batch=1, heads=4, seqlen=2048, head_dim=64, causal=True)}]
    checks = [] if comparator else [s for s in man["shapes"] if s.get("check", True)] + extra
    ok = True
    for sh in checks:
        dims = sh["dims"]
        inp = spec.make_inputs(dims, gen, dev); outs = spec.make_outputs(dims, inp)
        for t in outs.values(): t.fill_(float("nan"))
        try:
            run(dims, inp, outs); torch.cuda.synchronize()
        except Exception as exc:
            res["checks"][sh["name"]] = f"ERROR {exc}"; ok = False; continue
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
                bad_idx = (err > lim).nonzero()[:3].tolist()
                msgs.append(f"first bad idx {bad_idx}")
        res["checks"][sh["name"]] = " ".join(msgs)
    res["check_ok"] = ok
    flush = torch.empty(256 << 20, dtype=torch.uint8, device=dev)
    if ok:
        for sh in [s for s in man["shapes"] if s.get("bench")]:
            dims = sh["dims"]
            sets = [spec.make_inputs(dims, gen, dev) for _ in range(2)]
            outs = [spec.make_outputs(dims, i) for i in sets]
            run(dims, sets[0], outs[0]); torch.cuda.synchronize()
            ts = []
            for r in range(12):
                i = r % 2; flush.zero_()
                s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                s.record(); run(dims, sets[i], outs[i]); e.record(); torch.cuda.synchronize()
                ts.append(s.elapsed_time(e) * 1e-3)
            med = sorted(ts)[len(ts) // 2]
            res["bench"][sh["name"]] = {"ms": med * 1e3, "tflops": spec.flops(dims) / med / 1e12}
            del sets, outs
    (Path(outdir) / f"{name}.json").write_text(json.dumps(res, indent=1))
    print(json.dumps(res))


def main():
    root, outdir = Path(sys.argv[1]).resolve(), Path(sys.argv[2])
    outdir.mkdir(parents=True, exist_ok=True)
    names = sys.argv[3:] or list(VARIANTS)
    t0 = time.time()
    procs = {n: build(root, n, *VARIANTS[n]) for n in names if n in VARIANTS}
    sos, results = {}, {}
    for n, (p, so) in procs.items():
        log = p.communicate()[0]
        (outdir / f"{n}.build.txt").write_text(log)
        regs = [l.strip() for l in log.splitlines() if "registers" in l or "spill" in l]
        results[n] = {"build_rc": p.returncode, "ptxas": regs}
        if p.returncode == 0: sos[n] = so
        else: print(n, "BUILD FAILED", log[-1500:])
    print(f"built in {time.time() - t0:.0f}s", flush=True)
    for n in list(sos) + ["sdpa_flash_attention", "sdpa_cudnn_attention"]:
        cname = {"sdpa_flash_attention": "sdpa_flash", "sdpa_cudnn_attention": "sdpa_cudnn"}.get(n, n)
        t1 = time.time()
        try:
            r = subprocess.run([sys.executable, __file__, "--child", str(root), cname, sos.get(n, ""), str(outdir)],
                               capture_output=True, text=True, timeout=45)
            (outdir / f"{cname}.log").write_text(r.stdout + r.stderr)
            line = [l for l in r.stdout.splitlines() if l.startswith("{")]
            results.setdefault(cname, {}).update(json.loads(line[-1]) if line else {"error": r.stderr[-800:]})
        except subprocess.TimeoutExpired:
            results.setdefault(cname, {})["error"] = "TIMEOUT (hang?)"
        print(f"{cname}: {time.time() - t1:.0f}s", flush=True)
    (outdir / "results.json").write_text(json.dumps(results, indent=1))
    # summary
    for n, r in results.items():
        print(f"== {n}: ptxas {r.get('ptxas', '')[-2:] if r.get('ptxas') else ''} err_hd96={r.get('err_hd96')} "
              f"check_ok={r.get('check_ok')} {r.get('error', '')}")
        for s, m in r.get("checks", {}).items():
            if "BAD" in m or "ERROR" in m or s.startswith("x_") or s in ("d128_s1_causal", "d64_s17"):
                print(f"   {s}: {m}")
    bench_names = sorted({s for r in results.values() for s in r.get("bench", {})})
    print(f"{'shape':18s}" + "".join(f"{n[:14]:>15s}" for n in results))
    for s in bench_names:
        print(f"{s:18s}" + "".join(
            f"{results[n]['bench'][s]['tflops']:9.1f}TF/s" if s in results[n].get("bench", {}) else f"{'-':>15s}"
            for n in results))
    import torch
    print(torch.cuda.get_device_name(), "torch", torch.__version__, "cuda", torch.version.cuda)
    print(subprocess.run(["nvcc", "--version"], capture_output=True, text=True).stdout.splitlines()[-1])
    print(subprocess.run(["nvidia-smi", "--query-gpu=driver_version,clocks.sm,clocks.max.sm", "--format=csv,noheader"],
                         capture_output=True, text=True).stdout)


if __name__ == "__main__":
    if sys.argv[1] == "--child":
        child(Path(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5])
    else:
        main()
