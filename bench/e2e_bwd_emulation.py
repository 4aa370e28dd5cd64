"""CPU emulation behind flash_attn_bwd's e2e bound (kernels/flash_attn_bwd/task.toml [e2e]).

Trains the e2e model of tools/e2e_attention.py with the reference forward and, as the backward, (a) the
task spec's reference, (b) an honest bf16 path (P and dS rounded to bf16 before their matmuls, as the
kernel does), (c) the same with a causal-mask leak: key i + 1 enters query i's P with a fixed weight LEAK.
Prints the last-40 mean loss against the all-reference run per seed, and whether each leak passes the task's
per-call check on every check shape (two rounds of inputs). The GPU counterpart is
tests/gpu/test_e2e_attention.py.

    python bench/e2e_bwd_emulation.py --seeds 1,2,3 --leaks 3e-4,5e-4 [--check-only]
"""

from __future__ import annotations

import argparse
import math

import torch

from tools.check import compare
from tools.e2e import ReferenceKernel
from tools.e2e_attention import attention_op, train, train_backward
from tools.spec import load_spec
from tools.task import load_task


def grads(q, k, v, o, do, lse, causal: bool, leak: float, bf16_path: bool):
    """dq, dk, dv of softmax(q k^T / sqrt(d)) v from the forward's lse, optionally leaky and bf16-rounded."""
    q, k, v, o, do = (t.float() for t in (q, k, v, o, do))
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    s, d = q.shape[-2], q.shape[-1]
    scale = 1 / math.sqrt(d)
    p = torch.exp((q @ k.transpose(-1, -2)) * scale - lse.unsqueeze(-1))
    if causal:
        i = torch.arange(s)
        masked, nxt = i[None, :] > i[:, None], i[None, :] == i[:, None] + 1
        p = torch.where(nxt & (leak > 0), torch.full_like(p, leak), torch.where(masked, torch.zeros_like(p), p))
    if bf16_path:
        p = p.bfloat16().float()
    dv = p.transpose(-1, -2) @ do
    ds = p * (do @ v.transpose(-1, -2) - (do * o).sum(-1, keepdim=True))
    if bf16_path:
        ds = ds.bfloat16().float()
    dq, dk = ds @ k * scale, ds.transpose(-1, -2) @ q * scale
    b, hk = q.shape[0], q.shape[1] // group
    dk, dv = dk.view(b, hk, group, s, d).sum(2), dv.view(b, hk, group, s, d).sum(2)
    return {"dq": dq.bfloat16(), "dk": dk.bfloat16(), "dv": dv.bfloat16()}


def kernel(leak: float):
    return lambda dims, ins: grads(ins["q"], ins["k"], ins["v"], ins["o"], ins["do"], ins["lse"], dims["causal"], leak, True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", default="1,2,3")
    ap.add_argument("--leaks", default="3e-4,5e-4")
    ap.add_argument("--check-only", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(2)
    task = load_task("kernels/flash_attn_bwd")
    spec, tol, cfg = load_spec(task.spec_path), task.manifest.tolerance, task.manifest.e2e
    leaks = [float(x) for x in args.leaks.split(",") if x]
    for leak in leaks:
        worst, ok = 0.0, True
        for shape in task.check_shapes:
            for rnd in range(2):
                ins = spec.make_inputs(shape.dims, torch.Generator().manual_seed(100 + rnd), torch.device("cpu"))
                ref = spec.reference(shape.dims, ins)
                got = kernel(leak)(shape.dims, ins)
                for n in ("dq", "dk", "dv"):
                    e = compare(n, got[n], ref[n], tol.atol, tol.rtol, tol.norm_rtol)
                    worst, ok = max(worst, e.norm_rel), ok and e.passed
        print(f"leak {leak:g}: per-call check {'passes' if ok else 'FAILS'} (worst norm-relative {worst:.4f}, bound {tol.norm_rtol})")
    if args.check_only:
        return 0
    cpu = torch.device("cpu")
    for seed in (int(s) for s in args.seeds.split(",")):
        ref = train(attention_op(), seed, cfg.steps, cpu)
        rm = sum(ref[-cfg.last:]) / cfg.last
        row = []
        for name, k in [("spec reference", ReferenceKernel(spec)), ("bf16 path", kernel(0.0))] + [(f"leak {x:g}", kernel(x)) for x in leaks]:
            c = train_backward(k, seed, cfg.steps, cpu)
            row.append(f"{name} {100 * (sum(c[-cfg.last:]) / cfg.last / rm - 1):+.4f}%")
        print(f"seed {seed}: " + " | ".join(row) + f"  (bound {100 * cfg.bound:g}%)", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
