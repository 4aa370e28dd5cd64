#!/usr/bin/env bash
# On the GPU box: `kloop export` of each shipped showcase run, `pip install DIR` into a fresh venv (with the
# machine's torch), each package's own test there, then the decoder example with both ops swapped in.
#   bash bench/export_showcase.sh          (writes under $OUT or /tmp; run after `source bench/device_provision.sh`)
#   PACKAGE_TESTS=0 bash bench/export_showcase.sh    (install only, no package tests: the decoder example sooner)
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-/tmp}
work=$(mktemp -d)
# a fresh install folder beside the machine's own python (its CUDA torch); no kloop on the path. (A venv with
# --system-site-packages does not see torch where python3 is itself a venv, as on the GPU box.)
site="$work/site"
rc=0
for run_dir in runs/showcase/*/*/; do
  run_dir=${run_dir%/}
  [ -f "$run_dir/run.json" ] || continue
  id=$(basename "$run_dir")
  git clone -q "$run_dir/session.bundle" "$work/repo-$id" 2>/dev/null
  git -C "$work/repo-$id" branch -q -f "kloop/$id" "origin/kloop/$id"
  pkg="$work/pkg-$id"
  if python3 -m agent.cli export "$PWD/$run_dir" --repo "$work/repo-$id" -o "$pkg" > "$out/export-$id.txt" 2>&1; then
    # the package needs nothing of kloop: no PYTHONPATH into the checkout
    (unset PYTHONPATH; cd "$work" && python3 -m pip install -q --no-deps --no-build-isolation --target "$site" "$pkg" \
      && { [ "${PACKAGE_TESTS:-1}" = 0 ] || PYTHONPATH="$site" python3 -m pytest -q -p no:cacheprovider "$pkg/tests"; }) \
      >> "$out/export-$id.txt" 2>&1 || rc=1
  else
    rc=1
  fi
  echo "== $id (rc so far $rc)"; tail -4 "$out/export-$id.txt"
done
(PYTHONPATH="$site" python3 examples/decoder_swap.py "$@") 2>&1 | tee "$out/decoder_swap.txt"
[ "${PIPESTATUS[0]}" = 0 ] || rc=1
exit $rc
