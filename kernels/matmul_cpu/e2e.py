"""matmul_cpu's end-to-end check (tools/e2e.py): least-squares regression trained by gradient descent to
its noise floor, with the candidate matmul computing both the forward (P = X @ W) and the backward's
weight gradient (dW = X^T @ dP).

Read-only like the spec: the gate trusts it. Everything comes from `seed`: X ~ N(0, 1) [512, 32], a
teacher W* ~ N(0, 1) [32, 8], targets Y = X W* plus label noise of NOISE (relative), W from zero,
plain gradient descent at the step size 1 / (l_min + l_max) of X^T X / n, which contracts the error by
~0.5 a step: the loss reaches its floor (NOISE^2 (1 - 32/512) relative to mean Y^2, ~3.8e-12) in ~25 of
the 40 steps, and the last 10 sit on it.

Why that floor: an fp32 product is only as good as its rounding, and the last steps measure exactly
that. An honest kernel's error (~1e-7 relative, any summation order) adds ~(1e-7 / 2e-6)^2 to the
floor: the last-10 mean stays within 0.7% of the reference run's on every seed tried (38 seeds
with torch's fp32 matmul and a sequential fp32 sum standing in, seeds 1-3 with the built i-j-k and
i-k-j loops, on the 2-core CPU box; 5% is the bound). A kernel that rounds every result
toward zero at 17 significant bits (relative error < 2^-17 = 7.6e-6: it passes the check's fp32
tolerance, norm error 1e-5) raises it by ~80% on every seed. A uniform scale (1 + d) of every result
is absorbed by the weights (W converges to W*/(1 + d)) and moves the floor by < 0.5%: scaling is not
what this check is for, a bias the model cannot learn away is.
"""

from __future__ import annotations

import torch

SAMPLES, FEATURES, OUTPUTS = 512, 32, 8
NOISE = 2e-6  # label noise relative to the targets' spread: the floor the last steps measure


def train(kernel, seed: int, steps: int, device: torch.device) -> list[float]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(SAMPLES, FEATURES, generator=gen)
    teacher = torch.randn(FEATURES, OUTPUTS, generator=gen)
    y64 = x.double() @ teacher.double()
    y64 += NOISE * y64.std() * torch.randn(SAMPLES, OUTPUTS, generator=gen, dtype=torch.float64)
    y = y64.float()
    scale = float((y64 ** 2).mean())
    eig = torch.linalg.eigvalsh(x.double().T @ x.double() / SAMPLES)
    lr = 1.0 / float(eig[0] + eig[-1])  # d(loss)/dW = (2/n) X^T (XW - Y): Hessian eigenvalues 2 * eig

    def matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        m, k = a.shape
        n = b.shape[1]
        return kernel({"m": m, "n": n, "k": k}, {"a": a.contiguous(), "b": b.contiguous()})["c"]

    x, y = x.to(device), y.to(device)
    xt = x.T.contiguous()
    w = torch.zeros(FEATURES, OUTPUTS, device=device)
    losses = []
    for _ in range(steps):
        p = matmul(x, w)  # forward through the candidate
        r = p - y
        losses.append(float((r.double() ** 2).mean()) / scale)  # the loss is the judge's, in fp64
        dw = matmul(xt, (2.0 / SAMPLES) * r)  # backward through the candidate
        w = w - lr * dw
    return losses
