"""Stand-alone GPU check of the paged_decode task, without kloop's harness (no pydantic needed).

    PYTHONPATH=$PWD python3 kernels/paged_decode/devcheck.py [--jobs N] [--reps N] [--no-time]

Builds the library with nvcc for the knob defaults, each single knob change and a few combinations;
checks every check shape of task.toml against spec.reference (NaN-poisoned outputs, inputs verified
unchanged, the manifest's tolerance); checks that unsupported configurations return an error; then
times the bench shapes (CUDA events, L2 flushed before each call, median) for every build and for the
comparators, and prints GB/s against the spec's bytes_moved. Needs torch with CUDA, nvcc, tools/spec.py.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import re
import subprocess
import sys
import tempfile
import time
import tomllib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))
from tools.spec import load_spec  # noqa: E402

NVCC_FLAGS = ["-gencode=arch=compute_90a,code=sm_90a", "-Xptxas=-v", "-Xcompiler=-fPIC", "-shared"]


def variants(manifest: dict) -> dict[str, dict]:
    knobs = manifest.get("knobs", {})
    defaults = {k: (v["default"] if isinstance(v, dict) else v[0]) for k, v in knobs.items()}
    out = {"default": dict(defaults)}
    for k, v in knobs.items():
        for val in v["values"] if isinstance(v, dict) else v:
            if val != defaults[k]:
                out[f"{k}={val}"] = {**defaults, k: val}
    combos = [
        {"QHEADS_PER_BLOCK": 4, "VEC": 8, "PARTITION_SIZE": 512},
        {"QHEADS_PER_BLOCK": 8, "VEC": 8, "THREADS": 256, "PARTITION_SIZE": 256},
        {"QHEADS_PER_BLOCK": 2, "VEC": 4, "THREADS": 64, "PARTITION_SIZE": 1024},
    ]
    for c in combos:
        if all(k in knobs for k in c):
            out["+".join(f"{k}={v}" for k, v in c.items())] = {**defaults, **c}
    return out


def build(name: str, knobs: dict, flags: list[str], workdir: Path) -> tuple[str, Path | None, str]:
    lib = workdir / (re.sub(r"[^A-Za-z0-9]+", "_", name) + ".so")
    cmd = ["nvcc", *NVCC_FLAGS, *flags, *[f"-D{k}={int(v) if isinstance(v, bool) else v}" for k, v in sorted(knobs.items())],
           str(HERE / "paged_decode.cu"), "-o", str(lib)]
    p = subprocess.run(cmd, capture_output=True, text=True)
    log = p.stdout + p.stderr
    if p.returncode != 0:
        return name, None, log
    regs = re.findall(r"Used (\d+) registers", log)
    spills = sum(int(x) for x in re.findall(r"(\d+) bytes spill (?:stores|loads)", log))
    return name, lib, f"regs {'/'.join(regs)} spill bytes {spills}"


def errors(out: torch.Tensor, ref: torch.Tensor, tol: dict) -> tuple[bool, float, float, float]:
    o, r = out.float(), ref.float()
    if not torch.isfinite(o).all():
        return False, float("nan"), float("nan"), float("nan")
    diff = (o - r).abs()
    bound = tol.get("atol", 0) + tol.get("rtol", 0) * r.abs()
    worst = float((diff / bound).max())  # <= 1 passes
    norm = float(diff.norm() / r.norm().clamp_min(1e-30))
    ok = worst <= 1.0 and (tol.get("norm_rtol") is None or norm <= tol["norm_rtol"])
    return ok, float(diff.max()), worst, norm


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 4)
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--no-time", action="store_true")
    ap.add_argument("--only", default="", help="comma-separated variant names to keep")
    args = ap.parse_args()

    manifest = tomllib.loads((HERE / "task.toml").read_text())
    spec = load_spec(HERE / manifest.get("spec", "spec.py"))
    tol = manifest.get("tolerance", {})
    shapes = manifest["shapes"]
    dev = torch.device("cuda")
    nvcc_v = subprocess.run(["nvcc", "--version"], capture_output=True, text=True).stdout.strip().splitlines()[-1]
    try:
        drv = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True).stdout.strip()
    except OSError:
        drv = "?"
    print(f"GPU {torch.cuda.get_device_name()} | driver {drv} | {nvcc_v} | torch {torch.__version__}", flush=True)

    vs = variants(manifest)
    if args.only:
        keep = set(args.only.split(","))
        vs = {k: v for k, v in vs.items() if k in keep or k == "default"}
    workdir = Path(tempfile.mkdtemp(prefix="paged_decode_"))
    t0 = time.time()
    with ThreadPoolExecutor(args.jobs) as ex:
        built = list(ex.map(lambda kv: build(kv[0], kv[1], manifest.get("flags", []), workdir), vs.items()))
    print(f"built {len(built)} variants in {time.time() - t0:.1f} s", flush=True)
    libs = {}
    failures = []
    for name, lib, info in built:
        if lib is None:
            print(f"BUILD FAILED {name}:\n{info[-3000:]}")
            failures.append(f"build {name}")
            continue
        print(f"  {name:55s} {info}")
        cdll = ctypes.CDLL(str(lib))
        spec.setup(cdll)
        libs[name] = cdll

    stream = torch.cuda.current_stream().cuda_stream

    # -- unsupported configurations must return an error and launch nothing ----------------------
    lib0 = libs["default"]
    q = torch.zeros(2, 8, 128, dtype=torch.bfloat16, device=dev)
    o = torch.full_like(q, float("nan"))
    kc = torch.zeros(4, 16, 2, 128, dtype=torch.bfloat16, device=dev)
    bt = torch.zeros(2, 2, dtype=torch.int32, device=dev)
    ln = torch.ones(2, dtype=torch.int32, device=dev)
    P = lambda t: ctypes.c_void_p(t.data_ptr())  # noqa: E731
    for what, args_ in [("head_dim 96", (2, 8, 2, 96, 16, 2)), ("q_heads % kv_heads", (2, 8, 3, 128, 16, 2)),
                        ("page_size 0", (2, 8, 2, 128, 0, 2))]:
        st = lib0.kloop_paged_decode(P(q), P(kc), P(kc), P(bt), P(ln), P(o), *args_, ctypes.c_float(0.1), ctypes.c_void_p(stream))
        torch.cuda.synchronize()
        ok = st != 0 and bool(torch.isnan(o).all())
        print(f"unsupported {what}: status {st} {'ok' if ok else 'FAIL'}")
        if not ok:
            failures.append(f"unsupported {what}")

    # -- correctness: every check shape, every variant ---------------------------------------------
    rows = []
    for i, sh in enumerate(shapes):
        if not sh.get("check", True):
            continue
        dims = sh["dims"]
        gen = torch.Generator(device=dev)
        gen.manual_seed(1234 + i)
        inputs = spec.make_inputs(dims, gen, dev)
        saved = {k: v.clone() for k, v in inputs.items()}
        ref = spec.reference(dims, inputs)["out"]
        worst_name, worst = "", (True, 0.0, 0.0, 0.0)
        n_ok = 0
        runners = {n: (lambda o, lib=lib: spec.launch(lib, dims, inputs, o, stream)) for n, lib in libs.items()}
        runners.update({n: (lambda o, fn=fn: fn(dims, inputs, o)) for n, fn in spec.comparators.items()})
        for name, run in runners.items():
            outs = spec.make_outputs(dims, inputs)
            for t in outs.values():
                t.fill_(float("nan"))
            try:
                run(outs)
                torch.cuda.synchronize()
            except Exception as exc:  # noqa: BLE001
                print(f"FAIL {sh['name']} {name}: {exc}")
                failures.append(f"{sh['name']} {name}: {exc}")
                continue
            e = errors(outs["out"], ref, tol)
            same = all(torch.equal(inputs[k], saved[k]) for k in inputs)
            if not e[0] or not same:
                print(f"FAIL {sh['name']} {name}: maxabs {e[1]:.3g} worst/bound {e[2]:.3g} norm {e[3]:.3g} inputs_unchanged {same}")
                failures.append(f"{sh['name']} {name}")
            else:
                n_ok += 1
            if not (e[2] <= worst[2]):
                worst_name, worst = name, e
        rows.append((sh["name"], n_ok, len(runners), worst[1], worst[2], worst[3], worst_name))
        del inputs, saved, ref
        torch.cuda.empty_cache()
    print("\ncorrectness (worst variant per shape; worst/bound <= 1 and norm <= norm_rtol pass)")
    print(f"{'shape':20s} {'pass':>7s} {'maxabs':>9s} {'worst/bnd':>9s} {'norm':>9s}  worst variant")
    for r in rows:
        print(f"{r[0]:20s} {r[1]:>3d}/{r[2]:<3d} {r[3]:9.2e} {r[4]:9.3f} {r[5]:9.2e}  {r[6]}")

    # -- timing ---------------------------------------------------------------------------------------
    if not args.no_time:
        flush = torch.empty(512 << 20, dtype=torch.uint8, device=dev)

        def timed(fn, reps):
            fn()
            torch.cuda.synchronize()
            ts = []
            for _ in range(reps):
                flush.zero_()
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                fn()
                b.record()
                b.synchronize()
                ts.append(a.elapsed_time(b) * 1e-3)
            ts.sort()
            return ts[len(ts) // 2]

        table = {}
        bench = [s for s in shapes if s.get("bench")]
        for sh in bench:
            dims = sh["dims"]
            gen = torch.Generator(device=dev)
            gen.manual_seed(99)
            inputs = spec.make_inputs(dims, gen, dev)
            outs = spec.make_outputs(dims, inputs)
            nbytes = spec.bytes_moved(dims)
            for name, lib in libs.items():
                t = timed(lambda: spec.launch(lib, dims, inputs, outs, stream), args.reps)
                table[(name, sh["name"])] = (t, nbytes / t)
            for cname, fn in spec.comparators.items():
                try:
                    t = timed(lambda: fn(dims, inputs, outs), args.reps)
                except Exception as exc:  # noqa: BLE001
                    print(f"comparator {cname} failed on {sh['name']}: {exc}")
                    t = float("nan")
                table[(cname, sh["name"])] = (t, nbytes / t)
            del inputs, outs
            torch.cuda.empty_cache()
        names = list(libs) + list(spec.comparators)
        print("\ntiming: median us (GB/s by bytes_moved), L2 flushed before each call")
        print(f"{'variant':55s} " + " ".join(f"{s['name']:>22s}" for s in bench))
        for n in names:
            print(f"{n:55s} " + " ".join(
                f"{table[(n, s['name'])][0] * 1e6:10.1f} ({table[(n, s['name'])][1] / 1e9:7.0f})" for s in bench))
        best = {s["name"]: min((table[(n, s["name"])][0], n) for n in libs) for s in bench}
        for s in bench:
            for c in spec.comparators:
                tc = table[(c, s["name"])][0]
                print(f"{s['name']}: speedup over {c}: default {tc / table[('default', s['name'])][0]:.2f}x, "
                      f"best build {tc / best[s['name']][0]:.2f}x")
        print("\nbest build per bench shape: " + "; ".join(f"{k}: {v[1]} {v[0] * 1e6:.1f} us" for k, v in best.items()))

    print("\nRESULT:", "ALL PASS" if not failures else f"{len(failures)} FAILURES: {failures[:20]}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
