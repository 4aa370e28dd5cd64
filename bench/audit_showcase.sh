#!/usr/bin/env bash
# Today's gate (`kloop audit`) over every accepted commit of the shipped showcase runs. On the GPU box
# it runs every layer (check with today's adversarial shapes, paired timing); without a GPU, scope
# through the build audit. Exit 1 if any accepted commit would now be rejected.
#   bash bench/audit_showcase.sh [extra audit flags]    (writes under $OUT or /tmp)
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-/tmp}
rc=0
# the carried wheels (.whl) and the sandbox's packages where the machine lacks them
source bench/device_provision.sh > "${out:-/tmp}/provision.txt" 2>&1
for run_dir in runs/showcase/*/*/; do
  run_dir=${run_dir%/}
  [ -f "$run_dir/run.json" ] || continue
  id=$(basename "$run_dir")
  work=$(mktemp -d)
  git clone -q "$run_dir/session.bundle" "$work/repo" 2>/dev/null
  # the bundle holds the session branch as a remote ref: make it local, as in the user's repository
  git -C "$work/repo" branch -q -f "kloop/$id" "origin/kloop/$id"
  python3 -m agent.cli audit "$PWD/$run_dir" --repo "$work/repo" "$@" 2>&1 | tee "$out/audit-$id.txt"
  [ "${PIPESTATUS[0]}" = 0 ] || rc=1
  rm -rf "$work"
done
exit $rc
