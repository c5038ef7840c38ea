#!/bin/sh
# The image's entrypoint: makes mounted CURVE keys usable, then runs the command as PID 1.
#
# A Kubernetes Secret volume's files belong to root and are group-readable under fsGroup, but a
# zserve process refuses a secret key file that anyone but its owner may read
# (docs/security.md). With ZSERVE_KEYS_FROM set (the Secret's mount), its files are copied into
# ZSERVE_KEYS_DIR (default /tmp/zserve-keys, which cluster.toml's [security] keys_dir names),
# owned by this user, secret files 0600; a key named clients--NAME.key lands in clients/NAME.key
# (a Secret has no folders). `exec` keeps zserve PID 1, so SIGTERM reaches it and drains it.
set -eu
if [ -n "${ZSERVE_KEYS_FROM:-}" ]; then
    keys_dir="${ZSERVE_KEYS_DIR:-/tmp/zserve-keys}"
    mkdir -p "$keys_dir/clients"
    chmod 0700 "$keys_dir" "$keys_dir/clients"
    for source in "$ZSERVE_KEYS_FROM"/*; do
        name=$(basename "$source")
        case "$name" in
            clients--*) target="$keys_dir/clients/${name#clients--}" ;;
            *) target="$keys_dir/$name" ;;
        esac
        cat "$source" > "$target"
        chmod 0600 "$target"
    done
fi
exec "$@"
