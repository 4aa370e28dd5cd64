#!/usr/bin/env bash
# On the GPU machine (a bare, root container): kloop's Python dependencies from carried wheels
# (.whl) and the sandbox's system packages (bubblewrap, libseccomp) from carried Debian packages
# (.dogfood/debs, made by `apt-get download bubblewrap libseccomp2 libcap2`), where the host lacks them.
#   source bench/device_provision.sh
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site:$PWD
fi
export KLOOP_CACHE=${KLOOP_CACHE:-/tmp/kc} PYTHONUNBUFFERED=1
if [ -d .dogfood/debs ] && ! command -v bwrap >/dev/null; then
  rm -rf /tmp/debroot && mkdir -p /tmp/debroot
  for f in .dogfood/debs/*.deb; do dpkg -x "$f" /tmp/debroot; done
  # only the two files the sandbox needs, never a whole package over /
  cp /tmp/debroot/usr/bin/bwrap /usr/local/bin/bwrap
  libdir=$(dirname "$(ldconfig -p | awk '/libc.so.6 .*x86-64/{print $NF; exit}')")
  for lib in /tmp/debroot/{usr/,}lib/x86_64-linux-gnu/lib{seccomp,cap}.so.*; do
    [ -e "$lib" ] || continue
    [ -e "$libdir/$(basename "$lib")" ] || cp -a "$lib" "$libdir/"
  done
  ldconfig
fi
python3 -c "from tools.sandbox import status; s = status(); print('sandbox:', s.mechanism, '| available' if s.available else '| UNAVAILABLE: ' + s.reason)"
