"""Stand-alone GPU validation of flash_attn_fwd (no kloop install, no pydantic needed).

    PYTHONPATH=$PWD python3 kernels/flash_attn_fwd/devcheck.py [--out DIR] [--quick]

Builds the kernel with nvcc for the default knobs and each other knob value (plus a few extra
combinations for timing), checks every check shape of task.toml against spec.reference with the
manifest's tolerances (outputs poisoned with NaN, inputs verified unchanged), checks the error paths
(head_dim 96, knobs whose shared memory cannot fit), times a few bench shapes with CUDA events
against torch SDPA, and runs compute-sanitizer (memcheck, racecheck) on a small C++ driver.
"""

from __future__ import annotations

import argparse
import ctypes
import importlib.util
import math
import os
import re
import subprocess
import sys
import time
import tomllib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
SRC = HERE / "flash_attn_fwd.cu"
MANIFEST = tomllib.loads((HERE / "task.toml").read_text())


def load_spec():
    s = importlib.util.spec_from_file_location("fa_spec", HERE / "spec.py")
    mod = importlib.util.module_from_spec(s)
    s.loader.exec_module(mod)
    return mod


def knob_table():
    return {k: (v["values"], v["default"]) for k, v in MANIFEST["knobs"].items()}


def variants():
    knobs = knob_table()
    default = {k: d for k, (_, d) in knobs.items()}
    out = [("default", dict(default))]
    for k, (vals, d) in knobs.items():
        for v in vals:
            if v != d:
                out.append((f"{k}={v}", {**default, k: v}))
    return default, out


EXTRA = [  # further combinations worth timing
    ("M128_N32_W8", {"BLOCK_M": 128, "BLOCK_N": 32, "NUM_WARPS": 8, "STAGES": 2}),
    ("M64_N128_W8_S1", {"BLOCK_M": 64, "BLOCK_N": 128, "NUM_WARPS": 8, "STAGES": 1}),
    ("M128_N128_W8", {"BLOCK_M": 128, "BLOCK_N": 128, "NUM_WARPS": 8, "STAGES": 2}),  # d128: must refuse
]


def build(name, knobs, out_dir):
    so = out_dir / f"fa_{name.replace('=', '')}.so"
    cmd = ["nvcc", "-gencode", "arch=compute_90a,code=sm_90a", *MANIFEST["flags"], "-Xptxas", "-v", "-shared",
           "-Xcompiler", "-fPIC", *(f"-D{k}={v}" for k, v in knobs.items()), str(SRC), "-o", str(so)]
    p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode:
        raise RuntimeError(f"build {name} failed:\n{p.stderr[-3000:]}")
    regs = [ln.split("Used ")[1].split(" registers")[0] for ln in p.stderr.splitlines() if "Used " in ln]
    spills = [ln.strip() for ln in p.stderr.splitlines()
              if re.search(r"[1-9]\d* bytes spill (stores|loads)", ln)]
    return so, "/".join(regs), spills


def tol(name):
    t = dict(MANIFEST.get("tolerance", {}))
    t.update(MANIFEST.get("tolerance_for", {}).get(name, {}))
    return t


def compare(out, ref, t):
    out, ref = out.float(), ref.float()
    if not torch.isfinite(out).all():
        return False, float("nan"), float("nan")
    err = (out - ref).abs()
    ok = bool((err <= t.get("atol", 0) + t.get("rtol", 0) * ref.abs()).all())
    nrel = float(err.norm() / ref.norm().clamp_min(1e-30))
    if t.get("norm_rtol") is not None:
        ok = ok and nrel <= t["norm_rtol"]
    return ok, float(err.max()), nrel


def run_once(spec, lib, dims, inputs):
    outputs = spec.make_outputs(dims, inputs)
    for t in outputs.values():
        t.fill_(float("nan"))
    spec.launch(lib, dims, inputs, outputs, torch.cuda.current_stream().cuda_stream)
    torch.cuda.synchronize()
    return outputs


def time_ms(fn, reps=10, warm=3):
    for _ in range(warm):
        fn()
    ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b))
    ts.sort()
    return ts[len(ts) // 2]


DRIVER = r"""
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <cstdio>
#include <cstdlib>
#include <vector>
extern "C" int kloop_flash_attn_fwd(const __nv_bfloat16*, const __nv_bfloat16*, const __nv_bfloat16*, __nv_bfloat16*,
                                    float*, int, int, int, int, int, float, cudaStream_t);
int main() {
  int shapes[][5] = {{1, 2, 17, 64, 1}, {2, 1, 100, 128, 0}, {1, 1, 257, 128, 1}, {1, 2, 130, 64, 0}, {1, 1, 1, 128, 0}};
  int bad = 0;
  for (auto& s : shapes) {
    size_t n = (size_t)s[0] * s[1] * s[2] * s[3];
    std::vector<__nv_bfloat16> h(n);
    for (size_t i = 0; i < n; ++i) h[i] = __float2bfloat16((rand() % 2001 - 1000) / 500.f);
    __nv_bfloat16 *q, *k, *v, *o; float* lse;
    cudaMalloc(&q, n * 2); cudaMalloc(&k, n * 2); cudaMalloc(&v, n * 2); cudaMalloc(&o, n * 2);
    cudaMalloc(&lse, (size_t)s[0] * s[1] * s[2] * 4);
    cudaMemcpy(q, h.data(), n * 2, cudaMemcpyHostToDevice); cudaMemcpy(k, h.data(), n * 2, cudaMemcpyHostToDevice);
    cudaMemcpy(v, h.data(), n * 2, cudaMemcpyHostToDevice);
    int rc = kloop_flash_attn_fwd(q, k, v, o, lse, s[0], s[1], s[2], s[3], s[4], 0.125f, 0);
    cudaError_t e = cudaDeviceSynchronize();
    printf("shape b%d h%d s%d d%d c%d: rc=%d sync=%d\n", s[0], s[1], s[2], s[3], s[4], rc, (int)e);
    bad |= rc != 0 || e != cudaSuccess;
    cudaFree(q); cudaFree(k); cudaFree(v); cudaFree(o); cudaFree(lse);
  }
  return bad;
}
"""


def sanitize(out_dir, knobs, timeout=45):
    drv = out_dir / "sandrv.cu"
    drv.write_text(DRIVER)
    exe = out_dir / ("sandrv_" + "_".join(f"{k}{v}" for k, v in knobs.items()))
    subprocess.run(["nvcc", "-gencode", "arch=compute_90a,code=sm_90a", *MANIFEST["flags"], "-lineinfo",
                    *(f"-D{k}={v}" for k, v in knobs.items()), str(SRC), str(drv), "-o", str(exe)], check=True)
    res = {}
    for tool in ("memcheck", "racecheck"):
        try:
            p = subprocess.run(["compute-sanitizer", "--tool", tool, "--error-exitcode", "9", str(exe)],
                               capture_output=True, text=True, timeout=timeout)
            summary = [ln for ln in (p.stdout + p.stderr).splitlines() if "ERROR SUMMARY" in ln or "RACECHECK SUMMARY" in ln]
            res[tool] = f"rc={p.returncode} " + " | ".join(summary)
            if p.returncode:
                res[tool] += "\n" + (p.stdout + p.stderr)[-2500:]
        except subprocess.TimeoutExpired:
            res[tool] = f"timed out after {timeout}s"
    return res


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/fa_devcheck"))
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--no-sanitize", action="store_true")
    args = ap.parse_args()
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    t_start = time.time()
    spec = load_spec()
    dev = torch.cuda.get_device_name()
    smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,clocks.sm,clocks.max.sm", "--format=csv,noheader"],
                         capture_output=True, text=True).stdout.strip()
    nvcc = subprocess.run(["nvcc", "--version"], capture_output=True, text=True).stdout.strip().splitlines()[-1]
    print(f"# {dev} | {smi} | {nvcc} | torch {torch.__version__}", flush=True)

    default, check_variants = variants()
    all_variants = check_variants + ([] if args.quick else EXTRA)
    with ThreadPoolExecutor(max_workers=min(16, os.cpu_count() or 4)) as pool:
        builds = dict(zip([n for n, _ in all_variants], pool.map(lambda nv: build(nv[0], nv[1], out_dir), all_variants)))
    print(f"# built {len(builds)} variants in {time.time() - t_start:.1f}s", flush=True)
    libs = {}
    for name, (so, regs, spills) in builds.items():
        lib = ctypes.CDLL(str(so))
        spec.setup(lib)
        libs[name] = lib
        print(f"  {name:16s} regs(d128/d64)={regs} {'SPILLS ' + str(spills) if spills else ''}")

    # ---- correctness: every check shape, every variant --------------------------------------
    shapes = [s for s in MANIFEST["shapes"] if s.get("check", True)]
    gen = torch.Generator(device="cuda")
    rows, fails = [], 0
    for si, sh in enumerate(shapes):
        dims = sh["dims"]
        gen.manual_seed(1000 + si)
        inputs = spec.make_inputs(dims, gen, torch.device("cuda"))
        saved = {k: v.clone() for k, v in inputs.items()}
        ref = spec.reference(dims, inputs)
        for name, _ in check_variants:
            try:
                outs = run_once(spec, libs[name], dims, inputs)
            except RuntimeError as exc:
                rows.append((sh["name"], name, "ERR", str(exc), "", ""))
                fails += 1
                continue
            ok_o, eo, no = compare(outs["o"], ref["o"], tol("o"))
            ok_l, el, nl = compare(outs["lse"], ref["lse"], tol("lse"))
            same = all(torch.equal(inputs[k], saved[k]) for k in inputs)
            ok = ok_o and ok_l and same
            fails += not ok
            rows.append((sh["name"], name, "ok" if ok else "FAIL" + ("" if same else "(inputs changed)"),
                         f"{eo:.2e}", f"{el:.2e}", f"{no:.1e}/{nl:.1e}"))
    worst = {}
    for shape, name, st, eo, el, nn in rows:
        print(f"  check {shape:18s} {name:16s} {st:5s} max|dO|={eo} max|dLSE|={el} norm(O/LSE)={nn}")
        w = worst.setdefault(name, [0.0, 0.0, "ok"])
        if st == "ok":
            w[0], w[1] = max(w[0], float(eo)), max(w[1], float(el))
        else:
            w[2] = "FAIL"

    # ---- larger shapes for the default (grid size, 64-bit offsets, many tiles) -------------------
    big = [s for s in MANIFEST["shapes"] if s["name"] in ("d128_s4k_causal", "d64_s2k", "d128_s16k_causal")]
    if args.quick:
        big = big[:1]
    big_rows = []
    for sh in big:
        dims = sh["dims"]
        gen.manual_seed(7)
        inputs = spec.make_inputs(dims, gen, torch.device("cuda"))
        ref = spec.reference(dims, inputs)
        outs = run_once(spec, libs["default"], dims, inputs)
        ok_o, eo, no = compare(outs["o"], ref["o"], tol("o"))
        ok_l, el, nl = compare(outs["lse"], ref["lse"], tol("lse"))
        fails += not (ok_o and ok_l)
        big_rows.append(f"  big   {sh['name']:18s} default {'ok' if ok_o and ok_l else 'FAIL'} max|dO|={eo:.2e} max|dLSE|={el:.2e} norm={no:.1e}/{nl:.1e}")
        del inputs, ref, outs
        torch.cuda.empty_cache()
    print("\n".join(big_rows))

    # ---- error paths -------------------------------------------------------------------------
    errs = []
    dims = {"batch": 1, "heads": 1, "seqlen": 64, "head_dim": 96, "causal": False}
    inp = {k: torch.randn(1, 1, 64, 96, device="cuda").bfloat16() for k in "qkv"}
    o = {"o": torch.empty(1, 1, 64, 96, device="cuda", dtype=torch.bfloat16), "lse": torch.empty(1, 1, 64, device="cuda")}
    try:
        spec.launch(libs["default"], dims, inp, o, 0)
        errs.append("head_dim=96: NO ERROR (bad)")
        fails += 1
    except RuntimeError as exc:
        errs.append(f"head_dim=96 -> {exc}")
    if "M128_N128_W8" in libs:
        for d in (128, 64):
            dims = {"batch": 1, "heads": 2, "seqlen": 300, "head_dim": d, "causal": True}
            gen.manual_seed(3)
            inp = spec.make_inputs(dims, gen, torch.device("cuda"))
            try:
                outs = run_once(spec, libs["M128_N128_W8"], dims, inp)
                ref = spec.reference(dims, inp)
                ok = compare(outs["o"], ref["o"], tol("o"))[0] and compare(outs["lse"], ref["lse"], tol("lse"))[0]
                errs.append(f"M128_N128_W8 d{d}: launched, {'ok' if ok else 'WRONG'}")
                fails += not ok
            except RuntimeError as exc:
                errs.append(f"M128_N128_W8 d{d}: refused cleanly ({exc})")
            assert torch.cuda.synchronize() is None
    print("  " + "\n  ".join(errs), flush=True)

    # ---- timing ------------------------------------------------------------------------------
    byname = {s["name"]: s["dims"] for s in MANIFEST["shapes"]}
    sweep_shapes = ["d128_s4k", "d64_s2k_causal"]
    gated = [s["name"] for s in MANIFEST["shapes"] if s.get("bench")]
    tshapes = list(dict.fromkeys(sweep_shapes + gated))
    if args.quick:
        tshapes = tshapes[:1]
    timing = []
    for sname in tshapes:
        dims = byname[sname]
        gen.manual_seed(11)
        inputs = spec.make_inputs(dims, gen, torch.device("cuda"))
        outputs = spec.make_outputs(dims, inputs)
        fl = spec.flops(dims)
        row = {}
        for name, lib in libs.items():
            if name != "default" and sname not in sweep_shapes:
                continue
            if name == "M128_N128_W8" and dims["head_dim"] == 128:
                continue
            ms = time_ms(lambda: spec.launch(lib, dims, inputs, outputs, torch.cuda.current_stream().cuda_stream))
            row[name] = ms
        for cname, fn in spec.COMPARATORS.items():
            try:
                row[cname] = time_ms(lambda: fn(dims, inputs, outputs))
            except Exception as exc:  # backend unavailable
                row[cname] = float("nan")
                print(f"  {cname} on {sname}: {type(exc).__name__}: {str(exc)[:120]}")
        timing.append((sname, fl, row))
        del inputs, outputs
    torch.cuda.empty_cache()

    san = {}
    if not args.no_sanitize:
        for name, knobs in [("default", default), ("STAGES=1", {**default, "STAGES": 1})]:
            for tool, r in sanitize(out_dir, knobs).items():
                san[f"{tool} [{name}]"] = r

    # ---- summary table (last, so it is in the tail) ------------------------------------------
    print("\n==== summary ====")
    print(f"{dev} | {smi} | {nvcc} | torch {torch.__version__}")
    print(f"correctness: {len(shapes)} check shapes x {len(check_variants)} knob variants, failures={fails}")
    for name, (mo, ml, st) in worst.items():
        print(f"  {name:16s} {st:4s} worst max|dO|={mo:.2e} worst max|dLSE|={ml:.2e}")
    print("\n".join(big_rows))
    print("  " + "\n  ".join(errs))
    for tool, r in san.items():
        print(f"  sanitizer {tool}: {r}")
    print("timing (ms, median of 10 / TFLOP/s):")
    for sname, fl, row in timing:
        cells = "  ".join(f"{n}={ms:.3f}/{fl / ms / 1e9:.0f}" for n, ms in row.items())
        print(f"  {sname}: {cells}")
    print(f"total {time.time() - t_start:.0f}s")
    return 1 if fails else 0


if __name__ == "__main__":
    sys.exit(main())
