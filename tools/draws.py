"""The judge's input draws: a fresh generator state for every input set, from a keyed hash of the secret.

A kernel sees every input it is given, so whatever seeded them must not tell it anything about the
inputs it has not been given yet. One torch generator seeded once and drawn from in sequence does:
the CPU generator (mt19937) keeps only the low 32 bits of its seed, so the first values of the first
set give the seed by brute force (2^32 tries: about two minutes on one core, which an untimed probe or
warm-up call can spend) and with it every later set, the timed ones included. A kernel that knows the
next pass's inputs can compute its outputs off the clock and answer the timed calls from a table.

Here each draw reseeds the generator with 63 bits of BLAKE2b keyed by the decision's secret seed and
the draw's number. Recovering one draw's (at most 64-bit) seed from its values says nothing about the
next: that would take the key, 2^62 hashes away. Draws stay deterministic per secret seed (a failure
can be re-run), and the spec's `make_inputs(dims, gen, device)` contract is unchanged.
"""

from __future__ import annotations

import hashlib

import torch


class SecretDraws:
    """`next()`: the generator to draw one input set from, seeded anew each time. `seed`: the secret
    (any non-negative int); `domain`: keeps the check's, the timing's and the bench's streams apart
    even under one seed."""

    def __init__(self, seed: int, device: torch.device | str, domain: str = "inputs"):
        if seed < 0:
            raise ValueError(f"SecretDraws: the seed must be non-negative, got {seed}")
        self._key = hashlib.blake2b(seed.to_bytes((seed.bit_length() + 8) // 8, "little"), digest_size=32).digest()
        self._domain = domain.encode()[:16]  # BLAKE2b's personalisation holds 16 bytes
        self._gen = torch.Generator(device=device)
        self.drawn = 0

    def seed_of(self, i: int) -> int:
        """The generator seed of draw `i` (63 bits)."""
        h = hashlib.blake2b(i.to_bytes(8, "little"), key=self._key, person=self._domain, digest_size=8)
        return int.from_bytes(h.digest(), "little") >> 1

    def next(self) -> torch.Generator:
        self._gen.manual_seed(self.seed_of(self.drawn))
        self.drawn += 1
        return self._gen

    __call__ = next
