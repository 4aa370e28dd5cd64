"""The judge's input draws (tools/draws.py): a set's values must not predict the next set's.

The attack they close (found by a red-team run against matmul_cpu): torch's CPU generator keeps only
the low 32 bits of its seed, so a kernel brute-forces them from the first values of the first set it
is given (about two minutes of one core, spent in an untimed warm-up or probe call) and, with one
generator drawn in sequence, knows every later set: it computes the timed calls' outputs off the clock.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from tools.draws import SecretDraws  # noqa: E402

SECRET = (0x2B7E1516 << 32) | 0x28AED2A6  # a 62-bit-style secret whose low 32 bits the attacker recovers


def _continue_from(seed: int, skip: int, n: int) -> torch.Tensor:
    """What an attacker who knows a generator's seed predicts for the draw after `skip` values."""
    g = torch.Generator().manual_seed(seed)
    torch.randn(skip, generator=g)
    return torch.randn(n, generator=g)


def test_the_cpu_generator_keeps_only_32_bits_of_its_seed():
    """Why the draws are keyed: if this stops holding (a torch with a 64-bit CPU seed), the keyed draws
    are still right, only no longer the sole defence."""
    a = torch.randn(8, generator=torch.Generator().manual_seed(SECRET))
    b = torch.randn(8, generator=torch.Generator().manual_seed(SECRET & 0xFFFFFFFF))
    assert torch.equal(a, b)


def test_one_generator_in_sequence_gives_the_next_set_away():
    g = torch.Generator().manual_seed(SECRET)
    torch.randn(16, generator=g)  # the set the kernel is given
    following = torch.randn(16, generator=g)  # the set it is not
    assert torch.equal(_continue_from(SECRET & 0xFFFFFFFF, 16, 16), following)


def test_secret_draws_keep_the_next_set_from_one_sets_seed():
    draws = SecretDraws(SECRET, "cpu", "timing")
    given = torch.randn(16, generator=draws.next())
    following = torch.randn(16, generator=draws.next())
    recovered = draws.seed_of(0) & 0xFFFFFFFF  # all that brute force on `given` can recover
    assert torch.equal(torch.randn(16, generator=torch.Generator().manual_seed(recovered)), given)
    assert not torch.equal(_continue_from(recovered, 16, 16), following)
    # nor is the next seed a neighbour of the recovered one, or of the secret
    assert all(not torch.equal(torch.randn(16, generator=torch.Generator().manual_seed(s)), following)
               for s in (recovered + 1, draws.seed_of(0) + 1, SECRET, SECRET + 1))
    assert draws.drawn == 2


def test_draws_are_deterministic_per_secret_and_apart_per_domain():
    def first_values(seed: int, domain: str, n: int = 3) -> list[torch.Tensor]:
        d = SecretDraws(seed, "cpu", domain)
        return [torch.randn(4, generator=d.next()) for _ in range(n)]

    same = zip(first_values(SECRET, "timing"), first_values(SECRET, "timing"))
    assert all(torch.equal(a, b) for a, b in same)
    # the check's stream is not the timing's, and secrets that share their low 32 bits do not share draws
    assert not torch.equal(first_values(SECRET, "timing")[0], first_values(SECRET, "check")[0])
    assert not torch.equal(first_values(SECRET, "timing")[0], first_values(SECRET & 0xFFFFFFFF, "timing")[0])
    seeds = [SecretDraws(SECRET, "cpu").seed_of(i) for i in range(64)]
    assert len(set(seeds)) == 64 and all(0 <= s < 1 << 63 for s in seeds)


def test_a_negative_seed_is_refused_by_name():
    with pytest.raises(ValueError, match="non-negative.*-3"):
        SecretDraws(-3, "cpu")
