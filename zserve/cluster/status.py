"""``zserve status [ADDRESS]``: a running cluster's endpoints, roles, models, backends, readiness
and rates.

Asks the frontend at ADDRESS (default: the client address ``zserve up`` recorded for the one
running cluster in its state folder) for ``ClusterStatsRequest(reset=False)`` twice,
``--interval`` seconds apart, and prints what the second answer says plus the rates between the
two (requests by outcome, the scheduler's arrivals, each backend's busy fraction). Readiness is
the frontend's own (``zserve.frontend.readiness``: admitting, and every configured model served by
a live, warmed backend). Each role's pid and restart count come from the state file of the cluster
``zserve up`` recorded with that client address, which its supervisor rewrites whenever a
restarted role is ready (``-`` for a cluster started otherwise); a role's own stats give its
pid where they carry one.

Endpoints: every frontend's addresses as bound (client, OIP HTTP, OIP gRPC, metrics) come from
that same state file, which holds what each frontend reported when it was ready, so they are
right for port 0 and after a restart. A cluster ``zserve up`` did not start (one started in
Python, or roles started alone, or one on another host) has no state file here: then the
frontend at ADDRESS is the source, and its stats name its client address (the one asked) and
its metrics URL only.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

from zserve.client.cluster_stats import FRONTEND_AT_ADDRESS, frontend_stats_reader
from zserve.cluster.cli import endpoint_lines, recorded_state, state_dir_for

DEFAULT_INTERVAL_S = 1.0


def _recorded_address(state_dir_arg: str | None) -> str:
    state_dir = state_dir_for(state_dir_arg)
    found = sorted(state_dir.glob("*.json")) if state_dir.exists() else []
    if len(found) != 1:
        raise SystemExit(f"zserve status: {len(found)} clusters recorded in {state_dir}; "
                         "pass the frontend's client ADDRESS")
    addresses: list[str] = json.loads(found[0].read_text())["client_addresses"]
    return addresses[0]


def _rate(before: dict[str, Any], after: dict[str, Any], key: str, interval_s: float) -> float:
    return (float(after.get(key, 0)) - float(before.get(key, 0))) / interval_s


def _print_roles(stats: dict[str, Any], state: dict[str, Any]) -> None:
    """One line per role: answered (up) or silent, pid, restarts (from ``state``: ``-``)."""
    pids, restarts = state.get("pids", {}), state.get("restarts", {})

    def recorded(name: str, own_pid: Any = None) -> str:
        pid = own_pid if own_pid is not None else pids.get(name, "-")
        return f"pid {pid}  restarts {restarts.get(name, '-')}"

    print("roles:")
    print(f"  {stats['name']:<12} frontend  up      {recorded(stats['name'], stats.get('pid'))}"
          f"  incarnation {stats.get('incarnation')}  in flight {stats.get('pending')}")
    for name, peer in sorted(stats.get("cluster", {}).items()):
        print(f"  {name:<12} {peer.get('role', '?'):<9} up      "
              f"{recorded(name, peer.get('pid'))}")
    for name in stats.get("cluster_silent", []):
        print(f"  {name:<12} {'?':<9} silent  {recorded(name)}  (did not answer within 0.5 s)")


def _print_endpoints(address: str, stats: dict[str, Any], state: dict[str, Any]) -> None:
    """Every frontend's addresses from ``state`` (recorded by ``zserve up``: every frontend),
    else what the frontend at ``address`` says of itself (its own addresses as bound)."""
    endpoints: dict[str, dict[str, str]] | None = state.get("endpoints")
    if endpoints is None:
        own = {"client": address, **stats.get("endpoints", {})}
        if stats.get("metrics_url"):
            own.setdefault("metrics", stats["metrics_url"])
        endpoints = {stats["name"]: own}
    print("endpoints:")
    print("\n".join(endpoint_lines(endpoints)))


def _print_models(before: dict[str, Any], stats: dict[str, Any], interval_s: float) -> None:
    print("models:")
    backends = {name: peer for name, peer in stats.get("cluster", {}).items()
                if peer.get("role") == "backend"}
    unready = set(stats.get("unready_models", []))
    counters, counters0 = stats.get("counters", {}), before.get("counters", {})
    scheduled, scheduled0 = _shard_rows(stats), _shard_rows(before)
    for model, slo_ms in sorted(stats.get("slo_ms", {}).items()):
        live = [n for n, b in backends.items() if model in b.get("models", [])]
        warmed = [n for n in live if backends[n].get("warmed", {}).get(model)]
        ok = _rate(counters0, counters, f"outcome/{model}/ok", interval_s)
        row = scheduled.get(model, {})
        arrivals = _rate(scheduled0.get(model, {}), row, "arrived", interval_s)
        print(f"  {model:<12} SLO {slo_ms:g} ms  {'ready' if model not in unready else 'UNREADY'}"
              f"  backends {len(warmed)} warmed / {len(live)} live"
              f"  arrivals {arrivals:.1f} r/s  queued {row.get('queued', 0)}"
              f"  in flight {stats.get('models', {}).get(model, 0)}  ok {ok:.1f} r/s")


def _shard_rows(stats: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Each model's row of the shard that schedules it (arrivals, queue length)."""
    rows: dict[str, dict[str, Any]] = {}
    for peer in stats.get("cluster", {}).values():
        if peer.get("role") == "shard" and isinstance(peer.get("models"), dict):
            rows.update(peer["models"])
    return rows


def _print_backends(before: dict[str, Any], stats: dict[str, Any], interval_s: float) -> None:
    print("backends:")
    earlier = before.get("cluster", {})
    for name, peer in sorted(stats.get("cluster", {}).items()):
        if peer.get("role") != "backend":
            continue
        busy = _rate(earlier.get(name, {}), peer, "busy_total_s", interval_s)
        print(f"  {name:<12} device {peer.get('device')}  models "
              f"{','.join(peer.get('models', []))}  busy {busy:.0%}")


def _print_requests(before: dict[str, Any], stats: dict[str, Any], interval_s: float) -> None:
    counters, counters0 = stats.get("counters", {}), before.get("counters", {})
    received = _rate(counters0, counters, "received", interval_s)
    parts = [f"ok {_rate(counters0, counters, 'replied', interval_s):.1f}"]
    for key in sorted(counters):
        if key.startswith(("error_", "rejected_")):
            value = _rate(counters0, counters, key, interval_s)
            if value:
                parts.append(f"{key} {value:.1f}")
    print(f"requests over the last {interval_s:g} s: received {received:.1f} r/s; "
          + ", ".join(parts) + " r/s")


def _print_allowances(stats: dict[str, Any]) -> None:
    """The allowances the scheduler and this frontend plan with (``[scheduler] allowances``:
    learned ones with the quantile they plan with, their window's p99 and their bounds)."""
    parts = []
    for peer_name, peer in sorted(stats.get("cluster", {}).items()):
        if peer.get("role") == "shard" and isinstance(peer.get("allowances"), dict):
            for key in ("d_ctrl", "jitter"):
                parts.append(f"{peer_name} {key} {_allowance_text(peer['allowances'][key])}")
    if isinstance(stats.get("reply_allowance"), dict):
        parts.append(f"reply {_allowance_text(stats['reply_allowance'])}")
    if parts:
        print("allowances: " + "; ".join(parts))


def _allowance_text(entry: dict[str, Any]) -> str:
    text = f"{entry['value_ms']:.2f} ms"
    if "cap_ms" in entry:  # learned
        p99, planned = entry.get("p99_ms"), entry.get("quantile_ms")
        seen = "no samples" if p99 is None else f"p99 {p99:.2f} ms of {entry['samples']}"
        if planned is not None:  # the quantile planned with, where not the p99
            name = f"p{round(entry['quantile'] * 100)}"
            seen = seen if name == "p99" else f"{name} {planned:.2f} ms, {seen}"
        text += f" (learned: {seen}; floor {entry['floor_ms']:g}, cap {entry['cap_ms']:g})"
    return text


def _print_autoscale(stats: dict[str, Any]) -> None:
    """The frontend's autoscaling advice (``[autoscale] enabled``; its autoscale_advice)."""
    advice = stats.get("autoscale")
    if not advice:
        return
    print(f"autoscale: {_advice_line(advice)}")
    for kind, entry in sorted((advice.get("kinds") or {}).items()):  # [autoscale.kinds]
        print(f"  kind {kind}: {_advice_line(entry)}")


def _advice_line(advice: dict[str, Any]) -> str:
    return (f"advice {advice['advice_backends']} backends (serving "
            f"{advice['backends']}, bounds {advice['min_backends']}..{advice['max_backends']}); "
            f"last change {advice['change']:+d} ({advice['reason']}); bad rate "
            f"{advice['bad_rate']:.2%}, idle {advice['idle_fraction']:.1%}, needed "
            f"{advice['needed']:.2f}")


def main(argv: list[str]) -> int:
    """``zserve status [ADDRESS] [--state-dir DIR] [--interval S]``: print a running cluster's
    endpoints, roles, models, backends, readiness and request rates."""
    parser = argparse.ArgumentParser(prog="zserve status", description=main.__doc__)
    parser.add_argument("address", nargs="?", help="a frontend's client address "
                        "(default: the one `zserve up` recorded)")
    parser.add_argument("--state-dir")
    parser.add_argument("--interval", type=float, default=DEFAULT_INTERVAL_S,
                        help="seconds between the two reads the rates come from")
    args = parser.parse_args(argv)
    address = args.address or _recorded_address(args.state_dir)
    read = frontend_stats_reader(address)
    try:
        before = read(FRONTEND_AT_ADDRESS)
        time.sleep(args.interval)  # the rates' window, not a wait for something to happen
        stats = read(FRONTEND_AT_ADDRESS)
    except (TimeoutError, TypeError) as exc:
        print(f"zserve status: {exc}", file=sys.stderr)
        return 1
    print(f"cluster at {address}: {'ready' if stats.get('ready') else 'NOT READY'}")
    state = recorded_state(address, args.state_dir)
    _print_endpoints(address, stats, state)
    _print_roles(stats, state)
    _print_models(before, stats, args.interval)
    _print_backends(before, stats, args.interval)
    _print_requests(before, stats, args.interval)
    _print_allowances(stats)
    _print_autoscale(stats)
    return 0
