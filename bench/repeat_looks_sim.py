"""Optional stopping, simulated: an agent re-submits an A/A change (no real difference) until the gate accepts.

    python bench/repeat_looks_sim.py [--agents 2000] [--tries 10] [--seed 1] [--json OUT.json]

Each agent submits the same A/A change up to `--tries` times against one best, each time with a
longer gate (what an "undecided" reason suggests: --gate-seconds up to the most), and stops at its
first accept. Every decision is the gate's real estimator and criterion (tools/stats.PassCriterion
with the gate's default rules, agent/gate.py GateConfig): the judge's stopping rule after every pass
from MIN_PASSES on, then its decision at the time cap. Two gates are compared on the same draws:

  naive  every decision at the first look's level (what the gate did before looks were counted);
  spent  the i-th decision at this best at level alpha * 6 / (pi^2 i^2) (tools/stats.look_alpha).

Pass data are synthetic A/A timings with the heavy tails of a shared machine: per call a lognormal
jitter, and now and then a preempted call (5% of calls, a Pareto-tailed delay of 20% of a call and
up); per pass a drift both sides share (clocks, neighbours) and a small one of each side's own.
Printed: tries vs the cumulative false-accept rate (the share of agents accepted within that many
tries) for both gates. Target (GateConfig.false_accept_rate = 1%): spent stays at or below ~1%
however many tries. tests/test_repeat_looks.py runs a small, deterministic version in CI.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402

from agent.gate import GateConfig  # noqa: E402
from tools.ab import MIN_PASSES, PAIRS_PER_PASS  # noqa: E402
from tools.stats import MIN_EVIDENCE_STRETCH, DecisionRules, PassCriterion, look_alpha  # noqa: E402

SHAPES = {"sq192": 1.0, "wide": 1.0}
CALL_S = {"sq192": 2e-3, "wide": 1e-3}


def rules(look: int, config: GateConfig | None = None, min_gain: float = 0.01, allowance: float = 0.05) -> DecisionRules:
    cfg = config or GateConfig()
    return DecisionRules(min_gain=min_gain, allowances=dict.fromkeys(SHAPES, allowance),
                         alpha=look_alpha(cfg.false_accept_rate, look), min_passes=MIN_PASSES,
                         noisy_halfwidth=cfg.noisy_halfwidth, target_halfwidth=cfg.target_halfwidth,
                         min_pairs=cfg.min_pairs)


def aa_passes(rng: np.random.Generator, n: int, calls: int = PAIRS_PER_PASS, jitter: float = 0.03,
              tail_p: float = 0.05, tail_scale: float = 0.2, drift: float = 0.05, side: float = 0.01) -> list[dict]:
    """`n` passes of A/A timings: shape -> (sum A, sum B, calls, pairs) per pass."""
    out = []
    shared = np.exp(rng.normal(0, drift, n))  # the machine's drift in a pass: both sides alike
    per = {}
    for s, t in CALL_S.items():
        sums = []
        for _ in ("a", "b"):
            x = t * np.exp(rng.normal(0, jitter, (n, calls)))
            hit = rng.random((n, calls)) < tail_p
            x = x + hit * t * tail_scale * (1 + rng.pareto(1.5, (n, calls)))  # preempted calls
            sums.append(x.sum(axis=1) * shared * np.exp(rng.normal(0, side, n)))
        per[s] = sums
    for i in range(n):
        out.append({s: (float(per[s][0][i]), float(per[s][1][i]), calls, calls) for s in SHAPES})
    return out


def decide(passes: list[dict], look: int, cap: int, min_gain: float) -> str:
    """One decision: the judge's stopping rule after every pass; at `cap` passes (the time cap) it stops
    once the interval is narrow enough to decide, else goes on up to MIN_EVIDENCE_STRETCH x `cap`
    (tools/ab.py); then the verdict."""
    crit = PassCriterion(SHAPES, rules(look, min_gain=min_gain))
    stretch = int(MIN_EVIDENCE_STRETCH * cap)
    for i, p in enumerate(passes[:stretch]):
        crit.add_measurement(p)
        if crit.should_stop(i + 1 >= cap, i + 1 >= stretch):
            break
    return crit.decision().kind


def simulate(agents: int, tries: int, seed: int, min_gain: float = 0.01, cap0: int = 8, cap_max: int = 48) -> dict:
    """Cumulative false accepts after each try, naive and spent, on the same pass data."""
    rng = np.random.default_rng(seed)
    first = {"naive": [0] * tries, "spent": [0] * tries}  # agents first accepted at try i
    for _ in range(agents):
        done = {"naive": False, "spent": False}
        for i in range(tries):
            cap = min(cap_max, cap0 * 2 ** i)  # each re-submit with a longer gate, up to the most
            passes = aa_passes(rng, int(MIN_EVIDENCE_STRETCH * cap))
            for gate, look in (("naive", 1), ("spent", i + 1)):
                if not done[gate] and decide(passes, look, cap, min_gain) == "accept":
                    done[gate] = True
                    first[gate][i] += 1
            if all(done.values()):
                break
    cum = {g: [float(x) for x in np.cumsum(v) / agents] for g, v in first.items()}
    return {"agents": agents, "tries": tries, "seed": seed, "min_gain": min_gain, "cumulative": cum}


def table(result: dict) -> str:
    rows = [f"{'tries':>5} {'naive':>8} {'spent':>8}   (cumulative false-accept rate of an A/A change, "
            f"{result['agents']} agents, min_gain {result['min_gain']:.0%})"]
    for i in range(result["tries"]):
        rows.append(f"{i + 1:>5} {result['cumulative']['naive'][i]:>8.2%} {result['cumulative']['spent'][i]:>8.2%}")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--agents", type=int, default=2000)
    ap.add_argument("--tries", type=int, default=10)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    limit = GateConfig().false_accept_rate
    results, ok = [], True
    # the task's min_gain (1%), and the worst case for the error budget: a change exactly at the
    # threshold (A/A judged with min_gain 0), where each look's level binds exactly
    for min_gain in (0.01, 0.0):
        result = simulate(args.agents, args.tries, args.seed, min_gain=min_gain)
        print(table(result))
        final = result["cumulative"]["spent"][-1]
        print(f"spent: {final:.2%} after {args.tries} tries (budget {limit:.0%}); naive "
              f"{result['cumulative']['naive'][-1]:.2%}\n")
        ok = ok and final <= 1.5 * limit
        results.append(result)
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
