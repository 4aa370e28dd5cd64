"""flash_attn_bwd's end-to-end check (tools/e2e.py; read-only like the spec): the tiny causal LM of
tools/e2e_attention.py trained on seeded copy sequences, the reference computing every attention forward
(fp32, O rounded to bf16) and the candidate its backward (dQ, dK, dV from q, k, v, o, do, lse)."""

from tools.e2e_attention import train_backward as train  # noqa: F401  (tools/e2e.py calls `train`)
