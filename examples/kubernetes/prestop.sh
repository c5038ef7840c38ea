#!/bin/sh
# zserve-prestop: the preStop hook of every zserve pod (docs/kubernetes.md).
#
# Kubernetes takes a terminating pod out of its Services' endpoints while this runs, but not at
# once everywhere: the hook first waits ZSERVE_PRESTOP_DELAY_S (default 0; a frontend behind a
# Service sets a few seconds) so that no new request is routed here, then sends the role
# (PID 1, started by zserve-entrypoint with exec) SIGTERM, which drains it (docs/runtime.md,
# "Drain on SIGTERM"), and waits until it has exited. The kubelet's own SIGTERM then finds
# nothing to stop; terminationGracePeriodSeconds must cover the delay plus [cluster] drain_s.
set -u
sleep "${ZSERVE_PRESTOP_DELAY_S:-0}"
kill -TERM 1 2>/dev/null || exit 0
while kill -0 1 2>/dev/null; do
    sleep 0.2
done
