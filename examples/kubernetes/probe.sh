#!/bin/sh
# zserve-probe alive|ready: the exec probe of a scheduler or backend pod (docs/kubernetes.md).
#
# The role keeps two files in $ZSERVE_HEALTH_DIR (zserve/runtime/health_files.py): `alive`,
# touched every second by its event loop, and `ready`, present from the moment it serves until
# a drain is requested. `alive` passes while the file is at most ZSERVE_ALIVE_MAX_AGE_S (10) old;
# `ready` while the file exists. A frontend's probes are HTTP (/v2/health/live and /ready).
set -eu
dir="${ZSERVE_HEALTH_DIR:-/tmp/zserve-health}"
case "${1:-}" in
    ready) test -f "$dir/ready" ;;
    alive)
        touched=$(stat -c %Y "$dir/alive")
        test $(( $(date +%s) - touched )) -le "${ZSERVE_ALIVE_MAX_AGE_S:-10}" ;;
    *) echo "usage: zserve-probe alive|ready" >&2; exit 2 ;;
esac
