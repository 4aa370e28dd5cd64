"""On the GPU machine: can ncu read the performance counters inside kloop's sandbox (bubblewrap, all
capabilities dropped), and does its injection follow a child into a PID namespace of its own? Prints one
line per variant: the capabilities kept, whether a runner-like child sat in its own PID namespace, and
what ncu reported for a torch kernel (a throughput figure, or its error line).
    python3 bench/probe_ncu_sandbox.py
"""
from __future__ import annotations

import subprocess
import sys

from tools.profile import find_ncu, interpret_ncu_output, ncu_install_dirs
from tools.sandbox import sandboxed_argv, scrubbed_env, status

KERNEL = "import torch; x = torch.randn(1 << 22, device='cuda'); y = (x * 2).sum(); torch.cuda.synchronize(); print('ran')"


def main() -> int:
    ncu = find_ncu(dict(__import__("os").environ))
    print("sandbox:", status().mechanism, "| ncu:", ncu)
    for caps in ((), ("CAP_SYS_ADMIN",)):
        for pidns in (False, True):
            child = [sys.executable, "-c", KERNEL]
            if pidns:
                child = ["unshare", "--pid", "--fork", "--mount-proc", *child]
            argv = [ncu, "--target-processes", "all", "--csv", "--page", "raw", "--metrics",
                    "sm__throughput.avg.pct_of_peak_sustained_elapsed", *child]
            if pidns and "CAP_SYS_ADMIN" not in caps:
                label = "skipped (unshare needs CAP_SYS_ADMIN)"
                print(f"caps={list(caps)} child_pidns={pidns}: {label}")
                continue
            wrapped = sandboxed_argv(argv, readable=ncu_install_dirs(ncu), gpu=True, env=scrubbed_env(), cap_add=caps)
            p = subprocess.run(wrapped, capture_output=True, text=True, timeout=120)
            r = interpret_ncu_output(p.stdout, p.stderr, p.returncode, argv)
            fig = r.kernels[0].metrics if r.kernels else None
            print(f"caps={list(caps)} child_pidns={pidns}: status={r.status} kernels={len(r.kernels)} "
                  f"{'' if r.kernels else (r.reason or '')[:300]} {str(fig)[:120] if fig else ''}")
            if not r.kernels:
                print('   ', (p.stdout + p.stderr)[-600:].replace(chr(10), ' | '))
    return 0


if __name__ == "__main__":
    sys.exit(main())
