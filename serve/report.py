"""`online-opd report`: one PNG of served acceptance over time, per drafter version.

Two sources, two views of the same quantity, tau = 1 + accepted drafts per
drafted block (the target's own token counts, as in ``BufferReader.stats``):

* the trace buffer (``--buffer``): per record tau_r = 1 + accepted / blocks,
  drawn as a trailing rolling mean over ``--window-s`` seconds of capture time,
  weighted by blocks (a long request counts for its blocks, not once), one
  colour per ``drafter_version``; beside it the spread of tau_r per version
  with the block-weighted tau marked. This is what the trainer learns from.
* scrapes (``--scrapes``, written by ``online-opd scrape``): tau between two
  consecutive scrapes from vLLM's own counters,
  1 + d(vllm:spec_decode_num_accepted_tokens_total) / d(vllm:spec_decode_num_drafts_total),
  with a vertical line where ``online_opd_drafter_version`` changes and the
  trainer's ``online_opd_trainer_steps_total`` on a twin axis. This counts
  every request, captured or not, so it checks the buffer's figure.

The JSON summary on stdout gives per version records/blocks/tau, the time
span and the PNG path; ``--json`` adds the plotted series. ``report()`` is the
same for benchmarks. matplotlib is imported only when drawing, and through a
bare ``Figure`` on an Agg canvas rather than pyplot: no global backend switch,
no GUI, safe in a worker thread.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import sys
from bisect import bisect_right
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from online_opd.release.registry import version_number
from online_opd.traces.records import acceptance_length, pure_blocks_by_version

__all__ = ["ACCEPTED", "DRAFTS", "TRAINER_STEPS", "VERSION_GAUGE", "RecordPoint", "ReportError",
           "add_parser", "buffer_series", "buffer_summary", "load_records", "load_scrapes", "report",
           "run", "scrape_series"]

logger = logging.getLogger(__name__)

ACCEPTED = "vllm:spec_decode_num_accepted_tokens_total"
DRAFTS = "vllm:spec_decode_num_drafts_total"
VERSION_GAUGE = "online_opd_drafter_version"
TRAINER_STEPS = "online_opd_trainer_steps_total"
MAX_POINTS = 2000  # per plotted series: more points than pixels only slows the drawing


class ReportError(ValueError):
    """Inputs that give nothing to report (the CLI exits 2 with this message)."""


@dataclass(frozen=True)
class RecordPoint:
    """What the report keeps of one record: the tokens are dropped as soon as it is read."""

    time: float  # captured_at; 0 = unknown
    version: str
    blocks: int
    accepted: int

    @property
    def tau(self) -> float | None:
        return acceptance_length(self.accepted, self.blocks)


# ---------------------------------------------------------------- buffer


def load_records(buffer: Path | str) -> tuple[list[RecordPoint], int]:
    """Every record of the buffer (a folder or an ``s3://bucket/prefix`` URI) as ``RecordPoint``s, one
    per version that drafted pure blocks in it (records.py "Drafter versions"), and the number of
    corrupt segments skipped."""
    from online_opd.traces.buffer import BufferReader

    try:
        reader = BufferReader(buffer)
    except ValueError as exc:  # a URI of another scheme
        raise ReportError(f"buffer: {exc}") from exc
    if not reader.exists():
        what = "a directory" if isinstance(reader.root, Path) else "in an existing bucket"
        raise ReportError(f"buffer {buffer} is not {what}")
    points = [RecordPoint(r.captured_at, version, len(blocks), sum(b.num_accepted for b in blocks))
              for r in reader.iter_records()
              for version, blocks in (pure_blocks_by_version(r) or {r.drafter_version: []}).items()]
    return points, len(reader.corrupt)


def _version_order(points: list[RecordPoint]) -> list[str]:
    """Versions by first capture time (= promotion order); versions never timed go last."""
    first: dict[str, float] = {}
    for p in points:
        t = p.time if p.time > 0 else math.inf
        first[p.version] = min(first.get(p.version, math.inf), t)
    return sorted(first, key=lambda v: (first[v], v))


def _span(times: list[float]) -> dict[str, Any] | None:
    if not times:
        return None
    start, end = min(times), max(times)
    return {"start": start, "end": end, "seconds": end - start, "start_utc": _utc(start), "end_utc": _utc(end)}


def _utc(t: float) -> str:
    return datetime.fromtimestamp(t, timezone.utc).isoformat(timespec="seconds")


def buffer_summary(points: list[RecordPoint]) -> dict[str, Any]:
    """Per version records, blocks, accepted tokens and block-weighted tau, plus totals and time span."""
    versions: dict[str, dict[str, Any]] = {}
    for v in _version_order(points):
        versions[v] = {"records": 0, "blocks": 0, "accepted_tokens": 0, "tau": None,
                       "first_captured_at": None, "last_captured_at": None}
    for p in points:
        s = versions[p.version]
        s["records"] += 1
        s["blocks"] += p.blocks
        s["accepted_tokens"] += p.accepted
        if p.time > 0:
            s["first_captured_at"] = p.time if s["first_captured_at"] is None else min(s["first_captured_at"],
                                                                                        p.time)
            s["last_captured_at"] = p.time if s["last_captured_at"] is None else max(s["last_captured_at"],
                                                                                      p.time)
    for s in versions.values():
        s["tau"] = acceptance_length(s["accepted_tokens"], s["blocks"])
    blocks = sum(p.blocks for p in points)
    return {
        "records": len(points),
        "blocks": blocks,
        "tau": acceptance_length(sum(p.accepted for p in points), blocks),
        "records_without_time": sum(1 for p in points if p.time <= 0),
        "time_span": _span([p.time for p in points if p.time > 0]),
        "drafter_versions": versions,
    }


def buffer_series(points: list[RecordPoint], window_s: float) -> dict[str, list[tuple[float, float]]]:
    """Per version ``[(t, tau)]``: at each record's time, the block-weighted tau of that version's
    records captured in ``(t - window_s, t]``.

    Records without a capture time or without blocks are left out (they have
    no place on the axis or no tau). Long series are thinned to ``MAX_POINTS``
    evenly spaced points, the last one kept.
    """
    if window_s <= 0:
        raise ValueError(f"window must be positive, got {window_s}")
    out: dict[str, list[tuple[float, float]]] = {}
    for version in _version_order(points):
        pts = sorted((p for p in points if p.version == version and p.time > 0 and p.blocks),
                     key=lambda p: p.time)
        if not pts:
            continue
        times = [p.time for p in pts]
        cum_blocks, cum_acc = [0], [0]
        for p in pts:
            cum_blocks.append(cum_blocks[-1] + p.blocks)
            cum_acc.append(cum_acc[-1] + p.accepted)
        series = []
        for i in _thin(len(pts)):
            hi = bisect_right(times, times[i])  # every record at this same instant is in the window
            lo = bisect_right(times, times[i] - window_s)
            series.append((times[i], acceptance_length(cum_acc[hi] - cum_acc[lo], cum_blocks[hi] - cum_blocks[lo])))
        out[version] = series
    return out


def _thin(n: int, limit: int = MAX_POINTS) -> list[int]:
    if n <= limit:
        return list(range(n))
    return sorted({round(i * (n - 1) / (limit - 1)) for i in range(limit)})


# ---------------------------------------------------------------- scrapes


def load_scrapes(path: Path) -> tuple[list[dict[str, Any]], int]:
    """Scrapes of a JSONL file, sorted by time, and the number of unreadable lines skipped.

    ``null`` values (non-finite in the exposition) come back as NaN.
    """
    if not Path(path).is_file():
        raise ReportError(f"scrapes file {path} does not exist")
    scrapes, bad = [], 0
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                scrapes.append({"time": float(row["time"]),
                                "metrics": {k: math.nan if v is None else float(v)
                                            for k, v in row["metrics"].items()}})
            except (ValueError, KeyError, TypeError, AttributeError) as exc:
                bad += 1  # a torn last line while the scraper writes, a stray edit: skip, say so
                logger.warning("%s:%d: skipping unreadable scrape: %r", path, n, exc)
    scrapes.sort(key=lambda s: s["time"])
    return scrapes, bad


def _value(metrics: dict[str, float], name: str) -> float | None:
    """Sum of the samples of ``name`` whatever their labels; None when the scrape lacks it."""
    total, found = 0.0, False
    for key, value in metrics.items():
        if key == name or key.startswith(name + "{"):
            total += value
            found = True
    return total if found else None


def _same(a: float | None, b: float | None) -> bool:
    if a is None or b is None:
        return True  # a scrape without the series is no evidence of a change
    return a == b or (math.isnan(a) and math.isnan(b))


def scrape_series(scrapes: list[dict[str, Any]]) -> dict[str, Any]:
    """tau between consecutive scrapes, drafter-version changes and trainer steps.

    ``tau``: ``[(t, tau, drafts)]`` at the later scrape of each pair whose drafts
    counter moved; a pair where a counter went down (server restart) counts as
    a reset and gives no point. ``version_changes``: ``[(t, before, after)]``
    at the first scrape showing the new version. Per version, the deltas of
    pairs that both show that version are summed into ``by_version`` (a pair
    straddling a change is counted in the total only).
    """
    if not scrapes:
        raise ReportError("no scrapes to report on")
    with_counters = [s for s in scrapes if _value(s["metrics"], DRAFTS) is not None
                     and _value(s["metrics"], ACCEPTED) is not None]
    if len(with_counters) < 2:
        raise ReportError(f"need two scrapes with {DRAFTS} and {ACCEPTED}, found {len(with_counters)} "
                          f"(is speculative decoding on?)")
    tau: list[tuple[float, float, float]] = []
    by_version: dict[float, dict[str, float]] = {}
    total_drafts = total_acc = 0.0
    resets = 0
    for before, after in zip(with_counters, with_counters[1:]):
        m0, m1 = before["metrics"], after["metrics"]
        d_drafts = _value(m1, DRAFTS) - _value(m0, DRAFTS)
        d_acc = _value(m1, ACCEPTED) - _value(m0, ACCEPTED)
        if d_drafts < 0 or d_acc < 0:
            resets += 1
            continue
        if d_drafts == 0:
            continue  # idle: no drafts, no tau
        tau.append((after["time"], acceptance_length(d_acc, d_drafts), d_drafts))
        total_drafts += d_drafts
        total_acc += d_acc
        v0, v1 = _value(m0, VERSION_GAUGE), _value(m1, VERSION_GAUGE)
        if v0 is not None and v1 is not None and _same(v0, v1) and not math.isnan(v1):
            s = by_version.setdefault(v1, {"drafts": 0.0, "accepted_tokens": 0.0})
            s["drafts"] += d_drafts
            s["accepted_tokens"] += d_acc
    changes: list[tuple[float, float, float]] = []
    last: float | None = None
    for s in scrapes:
        v = _value(s["metrics"], VERSION_GAUGE)
        if v is None:
            continue
        if last is not None and not _same(last, v):
            changes.append((s["time"], last, v))
        last = v
    steps = [(s["time"], v) for s in scrapes if (v := _value(s["metrics"], TRAINER_STEPS)) is not None]
    return {
        "tau": tau,
        "tau_total": acceptance_length(total_acc, total_drafts),
        "drafts": total_drafts,
        "counter_resets": resets,
        "first_version": next((v for s in scrapes if (v := _value(s["metrics"], VERSION_GAUGE)) is not None),
                              None),
        "version_changes": changes,
        "by_version": {v: {**s, "tau": acceptance_length(s["accepted_tokens"], s["drafts"])}
                       for v, s in sorted(by_version.items())},
        "trainer_steps": steps,
    }


def _version_label(number: float | None, names: list[str]) -> str:
    """The buffer's name for a gauge value (``12.0`` -> ``v0012``) when one matches, else ``v12``."""
    if number is None or math.isnan(number):
        return "?"
    for name in names:
        if version_number(name) == number:
            return name
    return f"v{number:g}"


# ---------------------------------------------------------------- drawing


def _draw(out: Path, points: list[RecordPoint] | None, series: dict[str, list[tuple[float, float]]] | None,
          scraped: dict[str, Any] | None, window_s: float) -> None:
    import matplotlib
    import matplotlib.dates as mdates
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    rows = int(points is not None) + int(scraped is not None)
    fig = Figure(figsize=(13, 4.2 * rows), layout="constrained")
    FigureCanvasAgg(fig)
    grid = fig.add_gridspec(rows, 2, width_ratios=(3, 1))
    versions = _version_order(points) if points is not None else []
    palette = matplotlib.colormaps["tab10"]
    colour = {v: palette(i % 10) for i, v in enumerate(versions)}
    row = 0
    shared = None

    def as_dt(ts: list[float]) -> list[datetime]:
        return [datetime.fromtimestamp(t, timezone.utc) for t in ts]

    def date_axis(ax: Any) -> None:
        locator = mdates.AutoDateLocator()
        ax.xaxis.set_major_locator(locator)
        ax.xaxis.set_major_formatter(mdates.ConciseDateFormatter(locator))
        ax.set_xlabel("wall time (UTC)")
        ax.grid(alpha=0.3)

    if points is not None and series is not None:
        ax = fig.add_subplot(grid[row, 0])
        shared = ax
        for v in versions:
            timed = [p for p in points if p.version == v and p.time > 0 and p.blocks]
            idx = _thin(len(timed))
            ax.scatter(as_dt([timed[i].time for i in idx]), [timed[i].tau for i in idx], s=4, alpha=0.15,
                       color=colour[v], linewidths=0)
            if series.get(v):
                ts, taus = zip(*series[v])
                ax.plot(as_dt(list(ts)), taus, color=colour[v], lw=1.8, label=v)
        if not any(series.values()):
            ax.text(0.5, 0.5, "no records with a capture time", transform=ax.transAxes, ha="center")
        ax.set_ylabel("tau = 1 + accepted / block")
        ax.set_title(f"buffer: served acceptance length, rolling {window_s:g} s block-weighted mean")
        date_axis(ax)
        if any(series.values()):
            ax.legend(title="drafter version", fontsize=8, loc="best")

        box = fig.add_subplot(grid[row, 1])
        per_version = [[p.tau for p in points if p.version == v and p.blocks] for v in versions]
        keep = [i for i, taus in enumerate(per_version) if taus]
        if keep:
            parts = box.boxplot([per_version[i] for i in keep], positions=range(len(keep)), showfliers=False,
                                widths=0.6, patch_artist=True)
            for patch, i in zip(parts["boxes"], keep):
                patch.set_facecolor(colour[versions[i]])
                patch.set_alpha(0.45)
            summary = buffer_summary(points)["drafter_versions"]
            for x, i in enumerate(keep):
                s = summary[versions[i]]
                box.scatter([x], [s["tau"]], marker="D", color="black", zorder=3)
                box.annotate(f"{s['tau']:.2f}\nn={s['records']}", (x, s["tau"]), textcoords="offset points",
                             xytext=(8, 0), fontsize=7, va="center")
            box.set_xticks(range(len(keep)), [versions[i] for i in keep], rotation=30, ha="right", fontsize=8)
        box.set_title("tau per record (\u25c6 block-weighted)")
        box.grid(axis="y", alpha=0.3)
        row += 1

    if scraped is not None:
        ax = fig.add_subplot(grid[row, 0], sharex=shared)
        if scraped["tau"]:
            ts, taus, _ = zip(*scraped["tau"])
            ax.plot(as_dt(list(ts)), taus, marker=".", ms=3, lw=1.2, color="tab:blue",
                    label="1 + \u0394accepted / \u0394drafts")
        else:
            ax.text(0.5, 0.5, "no drafts between scrapes", transform=ax.transAxes, ha="center")
        for t, _, after in scraped["version_changes"]:
            ax.axvline(as_dt([t])[0], color="tab:red", ls="--", lw=1)
            ax.annotate(_version_label(after, versions), (as_dt([t])[0], 1), xycoords=("data", "axes fraction"),
                        xytext=(3, -12), textcoords="offset points", color="tab:red", fontsize=8)
        ax.set_ylabel("tau (vLLM counters)")
        first = _version_label(scraped["first_version"], versions)
        ax.set_title(f"scrapes: served acceptance length between scrapes (first version {first})")
        date_axis(ax)
        handles, labels = ax.get_legend_handles_labels()
        if scraped["trainer_steps"]:
            twin = ax.twinx()
            ts, steps = zip(*scraped["trainer_steps"])
            twin.step(as_dt(list(ts)), steps, where="post", color="tab:gray", alpha=0.7, label="trainer steps")
            twin.set_ylabel("trainer steps")
            h2, l2 = twin.get_legend_handles_labels()
            handles, labels = handles + h2, labels + l2
        if handles:
            ax.legend(handles, labels, fontsize=8, loc="best")

        bars = fig.add_subplot(grid[row, 1])
        if scraped["by_version"]:
            names = [_version_label(v, versions) for v in scraped["by_version"]]
            values = [s["tau"] for s in scraped["by_version"].values()]
            bars.bar(range(len(values)), values, color=[colour.get(n, "tab:blue") for n in names], alpha=0.7)
            for x, value in enumerate(values):
                bars.annotate(f"{value:.2f}", (x, value), ha="center", va="bottom", fontsize=8)
            bars.set_xticks(range(len(values)), names, rotation=30, ha="right", fontsize=8)
        else:
            bars.text(0.5, 0.5, "no drafter version series", transform=bars.transAxes, ha="center")
        bars.set_title("tau by version (vLLM counters)")
        bars.grid(axis="y", alpha=0.3)

    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)


# ---------------------------------------------------------------- entry points


def report(buffer: Path | str | None, scrapes: Path | None, out: Path, window_s: float = 60.0,
           series: bool = False) -> dict[str, Any]:
    """Draw the PNG at ``out`` and return the summary; ``series`` adds the plotted series.

    ReportError when neither input is given or one that is given has nothing to
    report (no records, fewer than two scrapes with the spec-decode counters).
    """
    if buffer is None and scrapes is None:
        raise ReportError("give --buffer and/or --scrapes")
    if window_s <= 0:
        raise ReportError(f"--window-s must be positive, got {window_s}")
    result: dict[str, Any] = {"png": str(out), "window_s": window_s}
    points = rolling = scraped = None
    if buffer is not None:
        points, corrupt = load_records(buffer)
        if not points:
            raise ReportError(f"buffer {buffer} holds no records"
                              + (f" ({corrupt} corrupt segments skipped)" if corrupt else ""))
        rolling = buffer_series(points, window_s)
        result["buffer"] = {"root": str(buffer), "corrupt_segments": corrupt, **buffer_summary(points)}
        if series:
            result["buffer"]["series"] = rolling
    if scrapes is not None:
        rows, bad = load_scrapes(Path(scrapes))
        if not rows:
            raise ReportError(f"scrapes file {scrapes} holds no readable scrapes"
                              + (f" ({bad} unreadable lines)" if bad else ""))
        scraped = scrape_series(rows)
        names = _version_order(points) if points else []
        steps = scraped["trainer_steps"]
        result["scrapes"] = {
            "path": str(scrapes),
            "scrapes": len(rows),
            "unreadable_lines": bad,
            "time_span": _span([r["time"] for r in rows]),
            "intervals_with_drafts": len(scraped["tau"]),
            "drafts": scraped["drafts"],
            "tau": scraped["tau_total"],
            "counter_resets": scraped["counter_resets"],
            "first_version": _version_label(scraped["first_version"], names),
            "version_changes": [{"time": t, "utc": _utc(t), "from": _version_label(a, names),
                                 "to": _version_label(b, names)} for t, a, b in scraped["version_changes"]],
            "drafter_versions": {_version_label(v, names): s for v, s in scraped["by_version"].items()},
            "trainer_steps": {"first": steps[0][1], "last": steps[-1][1]} if steps else None,
        }
        if series:
            result["scrapes"]["series"] = [{"time": t, "tau": x, "drafts": d} for t, x, d in scraped["tau"]]
    _draw(Path(out), points, rolling, scraped, window_s)
    return result


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add the ``report`` command to ``subparsers`` (from ``add_subparsers``)."""
    p = subparsers.add_parser(
        "report", help="PNG of served acceptance over time per drafter version (buffer and/or scrapes)",
        description="Draw served acceptance length (tau) over wall time from a trace buffer (per drafter "
                    "version) and/or a scrapes file written by `online-opd scrape` (vLLM counters, "
                    "drafter-version changes, trainer steps). Summary JSON on stdout.")
    p.add_argument("--buffer", default=None, help="trace-buffer directory, or s3://bucket/prefix")
    p.add_argument("--scrapes", type=Path, default=None, help="JSONL written by `online-opd scrape`")
    p.add_argument("--out", type=Path, required=True, help="PNG to write")
    p.add_argument("--window-s", type=float, default=60.0,
                   help="rolling window of the buffer curve, seconds (default: %(default)s)")
    p.add_argument("--json", action="store_true", help="also print the plotted series in the JSON")
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    """Run ``report``; 2 with a one-line message on stderr when the inputs give nothing to draw."""
    try:
        result = report(args.buffer, args.scrapes, args.out, args.window_s, series=args.json)
    except ReportError as exc:
        print(f"online-opd report: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(result, indent=2))
    return 0
