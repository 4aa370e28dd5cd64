"""flash_attn_fwd's end-to-end check (tools/e2e.py; read-only like the spec): the tiny causal LM of
tools/e2e_attention.py trained on a seeded copy task, the candidate computing every attention forward,
the reference (fp32 autograd on a recomputation) its backward."""

from tools.e2e_attention import train_forward as train  # noqa: F401  (tools/e2e.py calls `train`)
