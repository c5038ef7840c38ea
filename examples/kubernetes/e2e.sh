#!/bin/bash
# The Kubernetes end-to-end run on one machine, with podman (docs/kubernetes.md, "Tested here").
#
#   examples/kubernetes/e2e.sh            # from the repository root; 2-6 minutes
#
# 1. builds the image from the Containerfile (the base: $BASE, else localhost/python-base:bookworm,
#    made with debootstrap from Debian's packages when it is missing: no registry needed);
# 2. writes CURVE keys (zserve keys init, in the image) into the zserve-keys secret;
# 3. renders examples/kubernetes/overlays/cpu for podman (kube_render.py podman) and runs it with
#    `podman kube play`: two schedulers (active and standby), two frontends, two CPU backends;
# 4. waits until every pod is ready by its own readiness probe, then checks the answers of each
#    frontend over OIP HTTP and gRPC (tritonclient) against the model run here;
# 5. under open-loop load through the "Service" (e2e_client.py load: the ready frontends), does
#    a rolling restart: each pod in turn runs its preStop (zserve-prestop: SIGTERM, drain), its
#    container exits and podman restarts it (restartPolicy Always), and the next pod goes only
#    once it is ready again; every request must be answered correctly;
# 6. with requests in flight, every pod is stopped as the kubelet deletes one (SIGTERM; podman
#    4.3's kube down would SIGKILL), frontends first: every request sent is answered, every role
#    drains and exits 0; then `podman kube down` removes them.
#
# Needs: podman, debootstrap and runc (apt-get install -y podman debootstrap runc), a Python with
# numpy, onnxruntime, pyyaml and tritonclient[http,grpc] ($PYTHON, default python3), and the
# ports 27000-28020 free on 127.0.0.1. Podman's settings: $CONTAINERS_CONF (default
# ../shared/containers/containers.conf, or ../../shared from a worktree, where it exists).
# RATE: requests per second (10); POLICY: the scheduling policy (below); KEEP=1 leaves the pods
# running after a failure. The exit status is 0 only if every step passed.
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/../.." && pwd)
PYTHON=${PYTHON:-python3}
IMAGE=localhost/zserve:dev
BASE=${BASE:-localhost/python-base:bookworm}
RATE=${RATE:-10}
# The scheduling policy of the run (the manifests' own: deferred). On a 2-core machine that others
# load too, the deferred policy holds a lone request to its deadline's edge, where a stall of
# the host (a restarting pod's start-up takes a core for seconds) becomes a miss; eager starts
# each batch as soon as a backend is free (docs/kubernetes.md, "Tested here").
POLICY=${POLICY:-eager}
for conf in "$repo/../shared/containers/containers.conf" "$repo/../../shared/containers/containers.conf"; do
    if [ -z "${CONTAINERS_CONF:-}" ] && [ -f "$conf" ]; then export CONTAINERS_CONF=$conf; fi
done
work=$(mktemp -d /tmp/zserve-e2e.XXXXXX)
manifest=$work/zserve-podman.yaml
cleanup() {
    [ -n "${KEEP:-}" ] && { echo "KEEP set: left running ($manifest)"; return; }
    podman kube down "$manifest" >/dev/null 2>&1 || true
    podman secret rm zserve-keys >/dev/null 2>&1 || true
}
trap cleanup EXIT

step() { printf '\n=== %s (%s)\n' "$1" "$(date -u +%H:%M:%S)"; }
elapsed() { echo "$(( $(date +%s) - $1 )) s"; }
container() { echo "$1-pod-0-$2"; }   # podman kube play's name for a Deployment's container
role_of() { case "$1" in *scheduler*) echo scheduler ;; *frontend*) echo frontend ;; *) echo backend ;; esac; }
http_port() { echo $(( 28000 + 10 * ${1##*-} )); }

# Ready by the pod's own readiness probe: HTTP for a frontend, zserve-probe for the others.
pod_ready() {
    local pod=$1 role
    role=$(role_of "$pod")
    if [ "$role" = frontend ]; then
        "$PYTHON" -c "import sys, urllib.request as u; sys.exit(u.urlopen('http://127.0.0.1:$(http_port "$pod")/v2/health/ready', timeout=1).status != 200)" 2>/dev/null
    else
        podman exec "$(container "$pod" "$role")" zserve-probe ready 2>/dev/null
    fi
}
wait_ready() {  # POD TIMEOUT_S
    local deadline=$(( $(date +%s) + $2 ))
    until pod_ready "$1"; do
        if [ "$(date +%s)" -ge "$deadline" ]; then
            echo "$1 not ready after $2 s; its log:"; podman logs --tail 30 "$(container "$1" "$(role_of "$1")")"
            return 1
        fi
        sleep 0.5
    done
}

step "1. image build"
started=$(date +%s)
if ! podman image exists "$BASE"; then
    echo "building $BASE from Debian's packages (debootstrap)"
    mirror=$(awk '/^URIs:/{print $2; exit}' /etc/apt/sources.list.d/debian.sources)
    rootfs=$work/rootfs
    mkdir -p "$rootfs"
    debootstrap --variant=minbase --include=python3,python3-venv,python3-pip,ca-certificates \
        bookworm "$rootfs" "$mirror" >"$work/debootstrap.log"
    tar -C "$rootfs" -c . | podman import - "$BASE"
    rm -rf "$rootfs"
fi
# pip inside the build uses the host's network, certificates and package index settings.
mounts=(-v /etc/ssl/certs:/etc/ssl/certs:ro)
for path in /etc/pip.conf /opt/pypi /opt/pypi-more /opt/wheels; do
    [ -e "$path" ] && mounts+=(-v "$path:$path:ro")
done
podman build --network host "${mounts[@]}" --build-arg BASE="$BASE" -t "$IMAGE" "$repo" \
    >"$work/build.log" 2>&1 || { tail -30 "$work/build.log"; exit 1; }
grep -E '^STEP|^COMMIT|Successfully tagged' "$work/build.log" | sed 's/^/  /'
echo "image $IMAGE built on $BASE in $(elapsed "$started"): $(podman image inspect --format '{{.Size}}' "$IMAGE" | awk '{printf "%.0f MB", $1/1e6}')"
podman run --rm "$IMAGE" zserve --version

step "2. CURVE keys into the zserve-keys secret"
mkdir -m 0777 "$work/keys"
podman run --rm --user 0 -v "$work/keys:/out" "$IMAGE" zserve keys init /out/k >/dev/null
# A Secret has no folders: clients/NAME.key travels as clients--NAME.key (zserve-entrypoint).
# podman 4.3 writes a secret volume's values as given (undecoded), so they go in as text.
{
    echo "apiVersion: v1"; echo "kind: Secret"; echo "metadata: {name: zserve-keys}"; echo "data:"
    for file in "$work"/keys/k/*.key* "$work"/keys/k/clients/*.key; do
        name=$(basename "$file"); case "$file" in */clients/*) name="clients--$name" ;; esac
        echo "  $name: |"; sed 's/^/    /' "$file"
    done
} >"$work/keys-secret.yaml"
podman secret rm zserve-keys >/dev/null 2>&1 || true
podman secret create zserve-keys "$work/keys-secret.yaml" >/dev/null
echo "zserve-keys: $(grep -c ': |' "$work/keys-secret.yaml") key files"

step "3. podman kube play"
started=$(date +%s)
"$PYTHON" "$here/kube_render.py" podman "$here/overlays/cpu" "$POLICY" >"$manifest"
echo "cluster file: overlays/cpu's, on loopback, policy $POLICY"
pods=$(awk '/^kind: Deployment/{d=1} d && /^  name:/{print $2; d=0}' "$manifest")
echo "pods: $(echo $pods)"
podman kube play "$manifest" >/dev/null 2>"$work/play.log" || { cat "$work/play.log"; exit 1; }
for pod in $pods; do wait_ready "$pod" 300; echo "  $pod ready"; done
echo "every pod ready $(elapsed "$started") after kube play"
podman run --rm --entrypoint cat "$IMAGE" /opt/zserve/models/cnn-v1.onnx >"$work/cnn.onnx"

step "4. answers through each frontend (tritonclient, HTTP and gRPC)"
"$PYTHON" "$here/e2e_client.py" check --model-file "$work/cnn.onnx" --requests 20 \
    --frontend zserve-frontend-0=127.0.0.1:28000,127.0.0.1:28001 \
    --frontend zserve-frontend-1=127.0.0.1:28010,127.0.0.1:28011

step "5. rolling restart under load ($RATE requests/s through the Service)"
mkdir -p "$work/state/terminating"
"$PYTHON" "$here/e2e_client.py" load --model-file "$work/cnn.onnx" --state "$work/state" \
    --rate "$RATE" --frontend zserve-frontend-0=127.0.0.1:28000 \
    --frontend zserve-frontend-1=127.0.0.1:28010 >"$work/load.log" 2>&1 &
load_pid=$!
sleep 5
# A rollout's order: backends, then the schedulers (the active one first), then the frontends.
for pod in zserve-backend-0 zserve-backend-1 zserve-scheduler-a zserve-scheduler-b \
           zserve-frontend-0 zserve-frontend-1; do
    role=$(role_of "$pod"); ctr=$(container "$pod" "$role"); started=$(date +%s)
    before=$(podman inspect --format '{{.RestartCount}}' "$ctr")
    touch "$work/state/terminating/$pod"        # the endpoints controller drops it
    # The kubelet's preStop: SIGTERM, drain. podman may fail to read the exit code of an exec
    # whose container stopped under it (PID 1 exited): that is the point, so it is ignored.
    podman exec "$ctr" zserve-prestop 2>/dev/null || true
    until [ "$(podman inspect --format '{{.RestartCount}}' "$ctr")" != "$before" ]; do sleep 0.2; done
    code=$(podman logs --tail 200 "$ctr" 2>&1 | grep -c -E 'drain|handing over|withdrew' || true)
    wait_ready "$pod" 300
    rm -f "$work/state/terminating/$pod"
    echo "  $(date -u +%H:%M:%S) $pod: drained and exited, restarted by podman, ready again in $(elapsed "$started") ($code drain log lines)"
    sleep 3
done
touch "$work/state/stop"
wait "$load_pid" && load_ok=1 || load_ok=0
cat "$work/load.log"
for pod in zserve-scheduler-a zserve-scheduler-b; do
    { podman logs "$(container "$pod" scheduler)" 2>&1 | grep -E 'handing over|taking over|active|standby' || true; } | tail -4 | sed "s/^/  $pod: /"
done
[ "$load_ok" = 1 ] || { echo "FAIL: requests lost in the rolling restart"; exit 1; }

step "6. drain and podman kube down, with requests in flight"
# podman 4.3's kube down removes pods with SIGKILL at once (exit 137, measured), where deleting
# them on Kubernetes runs their preStop and sends SIGTERM within the grace period. So the pods are
# stopped first as the kubelet would (podman pod stop: SIGTERM, up to 30 s), in the order zserve
# down uses: the frontends (taken out of the Service first, as the endpoints controller does for
# a terminating pod), then the schedulers and backends; then kube down removes them.
rm -f "$work/state/stop"
"$PYTHON" "$here/e2e_client.py" load --model-file "$work/cnn.onnx" --state "$work/state" \
    --rate "$RATE" --frontend zserve-frontend-0=127.0.0.1:28000 \
    --frontend zserve-frontend-1=127.0.0.1:28010 >"$work/down-load.log" 2>&1 &
load_pid=$!
sleep 3
podman events --filter event=died --format '{{.Name}} exit {{.ContainerExitCode}}' >"$work/died.log" 2>&1 &
events_pid=$!
for pod in $pods; do
    podman logs -f --since 1s "$(container "$pod" "$(role_of "$pod")")" >"$work/$pod.down.log" 2>&1 &
done
started=$(date +%s)
frontends=$(for pod in $pods; do case "$pod" in *frontend*) echo "$pod" ;; esac; done)
for pod in $frontends; do touch "$work/state/terminating/$pod"; done
sleep 1
podman pod stop -t 30 $(for pod in $frontends; do echo "$pod-pod-0"; done) >/dev/null
touch "$work/state/stop"   # the Service has no endpoint left: the load ends
podman pod stop -t 30 $(for pod in $pods; do case "$pod" in *frontend*) ;; *) echo "$pod-pod-0" ;; esac; done) >/dev/null
echo "every pod stopped (SIGTERM, drained) $(elapsed "$started") after the first stop"
podman kube down "$manifest" >/dev/null 2>"$work/down.log" || { cat "$work/down.log"; exit 1; }
echo "podman kube down: pods removed"
wait "$load_pid" && down_ok=1 || down_ok=0
sleep 1; kill "$events_pid" 2>/dev/null || true
roles_died=$(grep -E '^zserve-' "$work/died.log" | grep -v -- '-infra' || true)
echo "$roles_died" | sed 's/^/  /'
for pod in $pods; do
    { grep -h -E 'draining|drained|withdrew|handing over|stopped;' "$work/$pod.down.log" || true; } \
        | tail -2 | cut -c1-150 | sed "s/^/  $pod: /"
done
tail -1 "$work/down-load.log"
if [ "$(echo "$roles_died" | grep -c 'exit 0$')" != "$(echo $pods | wc -w)" ]; then
    echo "FAIL: a role did not drain and exit 0"; exit 1
fi
[ "$down_ok" = 1 ] || { echo "FAIL: requests in flight at the stop were lost"; exit 1; }
printf '\nPASS: image built, kube play ready, answers correct, rolling restart lost no request, the stop drained every role and lost no request\n'
