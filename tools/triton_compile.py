"""The compile step of a Triton task's build, run INSIDE the build sandbox: `python triton_compile.py REQUEST OUT`.

Standalone on purpose (it imports nothing of kloop): tools/triton_build.py copies it into the build
folder and runs it under bubblewrap with the build folder as the only writable (and only non-toolchain
readable) path, no network and a minimal environment, exactly like a C++ compile. It is the only place
a candidate's Python is imported, and only after the static rules (tools/triton_rules.py) passed.

For each job of REQUEST (a kernel x one setting of its constexprs, num_warps, num_stages) it writes
OUT/<id>.cubin, OUT/<id>.ptx and OUT/<id>.json (Triton's launch metadata and the ptxas -v log). Its
output is data to the trusted side, which validates every field it uses.
"""

import contextlib
import importlib.util
import io
import json
import os
import sys
import traceback


@contextlib.contextmanager
def _fd2_to(path: str):
    """The process's stderr (fd 2: MLIR's and LLVM's C++ diagnostics, which sys.stderr never sees) into `path`
    while a job compiles, so each failure keeps its own diagnostics ("Pipeline failed while executing ...")."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(path, "wb") as f:
            os.dup2(f.fileno(), 2)
            try:
                yield
            finally:
                sys.stderr.flush()
                os.dup2(saved, 2)
    finally:
        os.close(saved)


def main(request_path: str, out_dir: str) -> int:
    req = json.load(open(request_path))
    os.environ["TRITON_DUMP_PTXAS_LOG"] = "1"  # Triton prints ptxas -v output: registers, spills per kernel
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # Triton 3.9 warns when unset; 1 is its default
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    target = GPUTarget("cuda", int(req["capability"]), 32)
    modules = {}
    failed = 0
    for job in req["jobs"]:
        out = {"id": job["id"], "ok": False}
        try:
            src = job["source"]
            if src not in modules:
                spec = importlib.util.spec_from_file_location(f"kloop_triton_src_{len(modules)}", src)
                mod = importlib.util.module_from_spec(spec)
                spec.loader.exec_module(mod)
                modules[src] = mod
            fn = getattr(modules[src], job["kernel"])
            signature = dict(job["signature"])
            signature.update({k: "constexpr" for k in job["constexprs"]})
            attrs = {(i,): [["tt.divisibility", 16]] for i in job["divisible"]}
            log = io.StringIO()
            with contextlib.redirect_stdout(log), _fd2_to(os.path.join(out_dir, f"{job['id']}.stderr")):
                compiled = triton.compile(ASTSource(fn, signature, job["constexprs"], attrs), target=target,
                                          options={"num_warps": job["num_warps"], "num_stages": job["num_stages"]})
            md = compiled.metadata
            ptx = compiled.asm["ptx"]
            with open(os.path.join(out_dir, f"{job['id']}.cubin"), "wb") as f:
                f.write(compiled.asm["cubin"])
            with open(os.path.join(out_dir, f"{job['id']}.ptx"), "w") as f:
                f.write(ptx)
            out.update(ok=True, name=md.name, shared=int(md.shared), num_warps=int(md.num_warps),
                       global_scratch_size=int(getattr(md, "global_scratch_size", 0) or 0),
                       global_scratch_align=int(getattr(md, "global_scratch_align", 1) or 1),
                       profile_scratch_size=int(getattr(md, "profile_scratch_size", 0) or 0),
                       profile_scratch_align=int(getattr(md, "profile_scratch_align", 1) or 1),
                       ptxas_log=log.getvalue()[-20000:], triton=triton.__version__)
        except Exception as exc:  # a compile error of the candidate's kernel: reported, not raised
            failed += 1
            out["error"] = f"{type(exc).__name__}: {exc}"[-6000:]
            out["where"] = traceback.format_exc(limit=4)[-2000:]
        with open(os.path.join(out_dir, f"{job['id']}.json"), "w") as f:
            json.dump(out, f)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))
