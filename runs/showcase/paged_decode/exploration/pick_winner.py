"""Pick the fastest variant of a devbench5 run that passed every check and write its source with its
build-time constants baked in as defaults (only the manifest's knobs reach a gated build), if it beats
the reference variant's bench workload (summed bench-shape times) by more than MARGIN.
    python3 pick_winner.py DEVBENCH.json REFERENCE OUT.cu [MARGIN]   -> prints the pick, exit 1 if none"""
import json
import sys
from pathlib import Path

HERE = Path(__file__).parent
KNOBS = {"THREADS", "QHEADS_PER_BLOCK", "VEC", "PARTITION_SIZE"}  # manifest knobs: the session's, not baked in


def workload(v: dict, bench: list) -> float | None:
    times = v.get("times") or {}
    if v.get("check") != "OK" or any(not times.get(b) for b in bench):
        return None
    return sum(times[b][0] for b in bench)


def main() -> int:
    data = json.loads(Path(sys.argv[1]).read_text())
    ref, out = sys.argv[2], Path(sys.argv[3])
    margin = float(sys.argv[4]) if len(sys.argv) > 4 else 0.03
    bench, variants = data["bench"], data["variants"]
    ref_t = workload(variants.get(ref, {}), bench)
    ranked = sorted((t, n) for n, v in variants.items() if n != ref and (t := workload(v, bench)) is not None)
    if ref_t is None or not ranked:
        print(f"no pick: reference {ref} workload {ref_t}, passing variants {len(ranked)}")
        return 1
    t, name = ranked[0]
    print(f"fastest passing: {name} {t * 1e6:.1f} us vs {ref} {ref_t * 1e6:.1f} us (x{ref_t / t:.3f})")
    if ref_t / t < 1 + margin:
        print(f"no pick: under the {margin:.0%} margin")
        return 1
    v = variants[name]
    baked = "".join(f"#define {k} {val}\n" for k, val in v["defines"].items() if k not in KNOBS)
    src = (HERE / v["source"]).read_text()
    out.write_text(f"// {name}: build-time constants of the measured variant, as defaults\n{baked}{src}")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
