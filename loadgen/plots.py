"""Plots of a report (live or simulated): PNG files, matplotlib as an optional extra.

``write_all(report, folder)`` draws what the report holds and returns the written paths:

- ``latency_cdf.png``: per-model latency CDF (live reports carry ``latency_cdf_ms``), with each
  model's SLO as a vertical line;
- ``batch_sizes.png``: the batch-size histogram;
- ``search.png``: the goodput search trace (each probe's worst bad rate against its rate, in
  probe order, with the pass bound);
- ``timeline.png``: per-second offered rate, goodput, bad rate and GPUs in use (live runs; most
  useful with a step schedule or a trace).

matplotlib is imported only here, inside the functions (``pip install 'zserve[plot]'``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any


def _pyplot() -> Any:
    try:
        import matplotlib
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise RuntimeError("plots need matplotlib: pip install 'zserve[plot]'") from exc
    matplotlib.use("Agg")  # files only, never a window
    import matplotlib.pyplot as plt

    return plt


def pyplot() -> Any:
    """matplotlib.pyplot on the Agg backend, for figures drawn elsewhere (loadgen.experiments)."""
    return _pyplot()


def save_figure(fig: Any, path: Path) -> Path:
    """Save ``fig`` as this module's PNGs are saved (tight layout, 110 dpi) and close it."""
    return _save(fig, path, _pyplot())


def latency_cdf(report: dict[str, Any], path: Path) -> Path | None:
    cdfs: dict[str, list[list[float]]] = report.get("latency_cdf_ms") or {}
    if not cdfs:
        return None
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, points in sorted(cdfs.items()):
        if not points:
            continue
        levels = [p[0] for p in points]
        values = [p[1] for p in points]
        (line,) = ax.plot(values, levels, label=name)
        slo = report.get("per_model", {}).get(name, {}).get("slo_ms")
        if slo:
            ax.axvline(slo, color=line.get_color(), linestyle=":", linewidth=1)
    ax.set_xlabel("latency (ms), served requests")
    ax.set_ylabel("fraction of requests")
    ax.set_ylim(0, 1.0)
    ax.set_title(f"{report.get('workload', '')}: latency CDF (dotted: SLO)")
    ax.grid(alpha=0.3)
    if len(cdfs) <= 12:
        ax.legend(fontsize="small")
    return _save(fig, path, plt)


def batch_sizes(report: dict[str, Any], path: Path) -> Path | None:
    histogram: dict[str, int] = (report.get("batch_size") or {}).get("histogram") or {}
    if not histogram:
        return None
    plt = _pyplot()
    sizes = sorted(int(k) for k in histogram)
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.bar(sizes, [histogram[str(s)] for s in sizes], width=0.8)
    median = report["batch_size"].get("median")
    if median is not None:
        ax.axvline(median, color="black", linestyle="--", linewidth=1, label=f"median {median:g}")
        ax.legend()
    ax.set_xlabel("batch size")
    ax.set_ylabel("batches")
    ax.set_title(f"{report.get('workload', '')}: batch sizes ({report.get('source', '')})")
    ax.grid(axis="y", alpha=0.3)
    return _save(fig, path, plt)


def search_trace(report: dict[str, Any], path: Path) -> Path | None:
    search = report.get("search") or {}
    probes = search.get("probes") or []
    if not probes:
        return None
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    rates = [p["rate"] for p in probes]
    bad = [max(p["bad_rate"], 1e-5) for p in probes]
    colors = ["tab:green" if p["pass"] else "tab:red" for p in probes]
    ax.plot(rates, bad, color="gray", linewidth=0.8, zorder=1)
    ax.scatter(rates, bad, c=colors, zorder=2)
    for i, (r, b) in enumerate(zip(rates, bad, strict=True)):
        ax.annotate(str(i + 1), (r, b), textcoords="offset points", xytext=(4, 4), fontsize=7)
    ax.axhline(search.get("max_bad_rate", 0.01), color="black", linestyle=":",
               label="max bad rate")
    goodput = report.get("goodput_rps")
    if goodput:
        ax.axvline(goodput, color="tab:green", linestyle="--", label=f"goodput {goodput:.0f} r/s")
    bound = report.get("bound_rps")
    if bound:
        ax.axvline(bound, color="tab:blue", linestyle="-.", label=f"bound {bound:.0f} r/s")
    ax.set_yscale("log")
    ax.set_xlabel("offered rate (r/s)")
    ax.set_ylabel("worst per-model bad rate")
    ax.set_title(f"{report.get('workload', '')}: goodput search (probe order numbered)")
    ax.legend(fontsize="small")
    ax.grid(alpha=0.3)
    return _save(fig, path, plt)


def timeline(report: dict[str, Any], path: Path) -> Path | None:
    series = report.get("timeline") or {}
    t = series.get("t_s") or []
    if not t:
        return None
    plt = _pyplot()

    def ext(values: list[Any]) -> list[Any]:
        return [*values, values[-1]]  # close the last one-second step

    t = ext(t)
    t[-1] = t[-2] + 1.0
    fig, (top, mid, low) = plt.subplots(3, 1, figsize=(8, 7), sharex=True)
    top.step(t, ext(series["offered_rps"]), where="post", label="offered")
    top.step(t, ext(series["good_rps"]), where="post", label="good")
    top.set_ylabel("requests/s")
    top.legend(fontsize="small")
    bad = [b if b is not None else float("nan") for b in series["bad_rate"]]
    mid.step(t, ext(bad), where="post", color="tab:red")
    mid.set_ylabel("bad rate")
    mid.set_ylim(bottom=0)
    busy = series.get("gpus_busy") or []
    active = series.get("gpus_active") or []
    if busy and busy[0] is not None:
        low.step(t, ext(busy), where="post", label="GPU-seconds busy per second")
    if active and active[0] is not None:
        low.step(t, ext(active), where="post", label="GPUs that ran a batch")
    low.set_ylabel("GPUs in use")
    low.set_xlabel("time since start (s)")
    if (busy and busy[0] is not None) or (active and active[0] is not None):
        low.legend(fontsize="small")
    for ax in (top, mid, low):
        ax.axvspan(series.get("measure_start_s", 0), series.get("measure_end_s", t[-1]),
                   color="gray", alpha=0.08)
        ax.grid(alpha=0.3)
    top.set_title(f"{report.get('workload', '')}: per second (shaded: measure window)")
    return _save(fig, path, plt)


def write_all(report: dict[str, Any], folder: str | Path) -> list[Path]:
    """Every plot the report supports, as PNG files in ``folder``."""
    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    written = [
        latency_cdf(report, out / "latency_cdf.png"),
        batch_sizes(report, out / "batch_sizes.png"),
        search_trace(report, out / "search.png"),
        timeline(report, out / "timeline.png"),
    ]
    return [p for p in written if p is not None]


def _save(fig: Any, path: Path, plt: Any) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
