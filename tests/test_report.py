"""`online-opd report` and `online-opd scrape`: the PNG and summary from a real
buffer and from a scrapes file, the /metrics flattening, the scrape loop
against a local HTTP server, and the Grafana dashboard's queries."""

from __future__ import annotations

import argparse
import dataclasses
import http.server
import json
import math
import re
import threading
from pathlib import Path

import pytest

from online_opd.traces.buffer import SegmentWriter
from online_opd.traces.records import BlockRecord, SequenceRecord
from serve import report as report_mod
from serve import scrape as scrape_mod
from serve.report import RecordPoint, buffer_series, load_scrapes, report, scrape_series
from serve.scrape import parse_metrics, scrape_loop

ROOT = Path(__file__).resolve().parents[1]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
T0 = 1_700_000_000.0

# Every series the dashboard may query: vLLM's and the ones online-opd exports (vllm_patches/metrics.py,
# the trainer, the gate).
KNOWN_METRICS = {
    "vllm:spec_decode_num_accepted_tokens_total",
    "vllm:spec_decode_num_drafts_total",
    "vllm:spec_decode_num_accepted_tokens_per_pos_total",
    "vllm:generation_tokens_total",
    "online_opd_drafter_version",
    "online_opd_served_acceptance_length",
    "online_opd_records_captured_total",
    "online_opd_records_dropped_total",
    "online_opd_records_opted_out_total",
    "online_opd_buffer_bytes",
    "online_opd_buffer_segments",
    "online_opd_trainer_steps_total",
    "online_opd_trainer_loss",
    "online_opd_trainer_replayed_tokens_total",
    "online_opd_trainer_up",
    "online_opd_gate_tau",
    "online_opd_gate_lower_bound",
    "online_opd_gate_promotions_total",
    "online_opd_gate_rejections_total",
    "online_opd_reloads_total",
    "online_opd_reload_duration_seconds_bucket",
    "online_opd_rollbacks_total",
    "online_opd_trainer_objective",
    "online_opd_trainer_first_position_acceptance",
    "online_opd_trainer_trained_tokens_total",
    "online_opd_trainer_fresh_records",
}


def make_record(i: int, version: str, blocks: list[tuple[int, int]], captured_at: float) -> SequenceRecord:
    """A chained record: ``blocks`` gives (K, r) per block."""
    tokens, out = [100 + i, 5, 6], []
    prompt_len = len(tokens)
    for k, r in blocks:
        anchor = len(tokens) - 1
        draft = [1000 + len(tokens) + j for j in range(k)]
        out.append(BlockRecord(anchor, tuple(draft), r))
        tokens += draft[:r] + [7]
    return SequenceRecord(record_id=f"{version}-{i}", model_id="tiny", drafter_version=version,
                          temperature=0.0, top_p=1.0, top_k=0, tokens=tuple(tokens), prompt_len=prompt_len,
                          blocks=tuple(out), captured_at=captured_at)


@pytest.fixture
def buffer(tmp_path) -> Path:
    """v0001 for 10 s at tau 2.5, then v0002 for 10 s at tau 4.0, in three segments."""
    root = tmp_path / "buffer"
    writer = SegmentWriter(root, writer_id="test")
    v1 = [make_record(i, "v0001", [(4, 1), (4, 2)], T0 + i) for i in range(10)]  # 3 accepted / 2 blocks
    v2 = [make_record(i, "v0002", [(4, 3), (4, 4), (4, 2)], T0 + 20 + i) for i in range(10)]  # 9 / 3
    writer.write(v1[:6])
    writer.write(v1[6:] + v2[:3])
    writer.write(v2[3:])
    return root


def scrape_row(t: float, drafts: float, accepted: float, version: float | None, steps: float | None) -> str:
    metrics = {"vllm:spec_decode_num_drafts_total": drafts,
               "vllm:spec_decode_num_accepted_tokens_total": accepted,
               "vllm:spec_decode_num_accepted_tokens_per_pos_total{position=0}": accepted / 2}
    if version is not None:
        metrics["online_opd_drafter_version"] = version
    if steps is not None:
        metrics["online_opd_trainer_steps_total"] = steps
    return json.dumps({"time": t, "metrics": metrics})


@pytest.fixture
def scrapes(tmp_path) -> Path:
    """Counters with an idle interval, a version change 1 -> 2 at t=1200 and a restart at t=1500."""
    rows = [  # time, drafts, accepted, version, trainer steps
        (T0 + 0, 0, 0, 1, 0),
        (T0 + 100, 100, 150, 1, 5),  # tau 2.5 (v1)
        (T0 + 200, 200, 250, 2, 10),  # tau 2.0, straddles the change
        (T0 + 300, 200, 250, 2, 15),  # idle: no point
        (T0 + 400, 300, 450, 2, 20),  # tau 3.0 (v2)
        (T0 + 500, 50, 10, 2, None),  # counters went down: restart, no point
        (T0 + 600, 150, 110, 2, 30),  # tau 2.0 (v2)
    ]
    path = tmp_path / "scrapes.jsonl"
    path.write_text("\n".join(scrape_row(*r) for r in reversed(rows)) + '\n{"time": 17000')  # torn last line
    return path


def report_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="command")
    report_mod.add_parser(sub)
    scrape_mod.add_parser(sub)
    return parser.parse_args(list(argv))


def assert_png(path: Path) -> None:
    assert path.is_file() and path.read_bytes()[:8] == PNG_MAGIC


# ---------------------------------------------------------------- report


def test_report_from_buffer_cli(buffer, tmp_path, capsys):
    out = tmp_path / "figs" / "report.png"
    assert report_mod.run(report_args("report", "--buffer", str(buffer), "--out", str(out),
                                      "--window-s", "5", "--json")) == 0
    summary = json.loads(capsys.readouterr().out)
    assert_png(out)
    assert summary["png"] == str(out)
    b = summary["buffer"]
    assert b["records"] == 20 and b["blocks"] == 50 and b["corrupt_segments"] == 0
    assert list(b["drafter_versions"]) == ["v0001", "v0002"]  # in order of first capture
    v1, v2 = b["drafter_versions"]["v0001"], b["drafter_versions"]["v0002"]
    assert (v1["records"], v1["blocks"], v1["tau"]) == (10, 20, 2.5)
    assert (v2["records"], v2["blocks"], v2["tau"]) == (10, 30, 4.0)
    assert b["tau"] == pytest.approx(1 + (30 + 90) / 50)
    assert b["time_span"]["start"] == T0 and b["time_span"]["end"] == T0 + 29
    # constant tau within a version: the rolling curve is flat at the version's tau
    assert {tau for _, tau in b["series"]["v0001"]} == {2.5}
    assert {tau for _, tau in b["series"]["v0002"]} == {4.0}


def test_records_spanning_a_reload_count_pure_blocks_under_their_version(tmp_path):
    base = make_record(0, "v0001", [(4, 1), (4, 2), (4, 3), (4, 4)], T0)
    b0, b1, b2, b3 = base.blocks
    spans = dataclasses.replace(base, blocks=(
        b0, dataclasses.replace(b1, drafter_version="v0002", is_context_pure=False),
        dataclasses.replace(b2, drafter_version="v0002"), dataclasses.replace(b3, drafter_version="v0002")))
    SegmentWriter(tmp_path, writer_id="test").write([spans])
    points, _ = report_mod.load_records(tmp_path)
    assert [(p.version, p.blocks, p.accepted) for p in points] == [("v0001", 1, 1), ("v0002", 2, 7)]


def test_rolling_tau_is_block_weighted_over_a_trailing_window():
    points = [RecordPoint(T0, "a", 1, 0), RecordPoint(T0 + 1, "a", 3, 3), RecordPoint(T0 + 10, "a", 1, 4),
              RecordPoint(T0 + 2, "b", 2, 2), RecordPoint(0.0, "a", 5, 5), RecordPoint(T0 + 3, "a", 0, 0)]
    series = buffer_series(points, window_s=5)
    # t=1: (0 + 3) / (1 + 3) -- not the mean of the record taus (1 and 2); t=10: only itself
    assert series["a"] == [(T0, 1.0), (T0 + 1, 1.75), (T0 + 10, 5.0)]
    assert series["b"] == [(T0 + 2, 2.0)]  # versions never mix; untimed/blockless records left out


def test_scrape_series(scrapes):
    rows, bad = load_scrapes(scrapes)
    assert len(rows) == 7 and bad == 1
    s = scrape_series(rows)
    assert s["tau"] == [(T0 + 100, 2.5, 100), (T0 + 200, 2.0, 100), (T0 + 400, 3.0, 100), (T0 + 600, 2.0, 100)]
    assert s["counter_resets"] == 1
    assert s["tau_total"] == pytest.approx(1 + 550 / 400)
    assert s["version_changes"] == [(T0 + 200, 1.0, 2.0)]
    assert s["first_version"] == 1.0
    # the interval straddling the change counts for neither version
    assert s["by_version"][1.0]["tau"] == 2.5 and s["by_version"][2.0]["tau"] == 2.5
    assert s["by_version"][2.0]["drafts"] == 200
    assert s["trainer_steps"][-1] == (T0 + 600, 30)


def test_report_from_scrapes_and_buffer_names_versions(buffer, scrapes, tmp_path):
    out = tmp_path / "both.png"
    result = report(buffer, scrapes, out, window_s=60)
    assert_png(out)
    s = result["scrapes"]
    assert s["scrapes"] == 7 and s["unreadable_lines"] == 1 and s["intervals_with_drafts"] == 4
    assert s["tau"] == pytest.approx(2.375)
    # gauge value 2 is shown under the buffer's name for that version
    assert [(c["from"], c["to"]) for c in s["version_changes"]] == [("v0001", "v0002")]
    assert s["first_version"] == "v0001" and set(s["drafter_versions"]) == {"v0001", "v0002"}
    assert s["trainer_steps"] == {"first": 0, "last": 30}
    assert "series" not in s and "series" not in result["buffer"]


def test_empty_inputs_exit_2(tmp_path, capsys):
    empty = tmp_path / "empty"
    SegmentWriter(empty, writer_id="test")  # creates the directory, writes nothing
    out = tmp_path / "r.png"
    assert report_mod.run(report_args("report", "--buffer", str(empty), "--out", str(out))) == 2
    assert "holds no records" in capsys.readouterr().err and not out.exists()
    assert report_mod.run(report_args("report", "--buffer", str(tmp_path / "nope"), "--out", str(out))) == 2
    assert "is not a directory" in capsys.readouterr().err
    assert report_mod.run(report_args("report", "--out", str(out))) == 2
    assert "--buffer and/or --scrapes" in capsys.readouterr().err
    one = tmp_path / "one.jsonl"
    one.write_text(scrape_row(T0, 1, 1, 1, None) + "\n")
    assert report_mod.run(report_args("report", "--scrapes", str(one), "--out", str(out))) == 2
    assert "need two scrapes" in capsys.readouterr().err
    assert capsys.readouterr().out == ""


# ---------------------------------------------------------------- scrape

EXPOSITION = """\
# HELP vllm:spec_decode_num_drafts Number of spec decoding drafts.
# TYPE vllm:spec_decode_num_drafts counter
vllm:spec_decode_num_drafts_total{engine="0",model_name="m"} 10.0
vllm:spec_decode_num_drafts_total{engine="1",model_name="m"} 5.0
# HELP vllm:spec_decode_num_accepted_tokens_per_pos Accepted tokens per position.
# TYPE vllm:spec_decode_num_accepted_tokens_per_pos counter
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="0"} 7.0
# HELP online_opd_reloads Drafter hot reloads by result.
# TYPE online_opd_reloads counter
online_opd_reloads_total{result="ok"} 2.0
# HELP online_opd_gate_tau Simulated tau.
# TYPE online_opd_gate_tau gauge
online_opd_gate_tau{version="v2",drafter="candidate"} 3.5
# HELP online_opd_drafter_version Drafter version.
# TYPE online_opd_drafter_version gauge
online_opd_drafter_version NaN
# HELP online_opd_reload_duration_seconds Reload time.
# TYPE online_opd_reload_duration_seconds histogram
online_opd_reload_duration_seconds_bucket{le="0.5"} 1.0
online_opd_reload_duration_seconds_bucket{le="+Inf"} 2.0
online_opd_reload_duration_seconds_count 2.0
online_opd_reload_duration_seconds_sum 0.75
"""


ONE_ENGINE = """\
vllm:spec_decode_num_drafts_total{model_name="other",engine="0"} 15.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{position="0",model_name="other",engine="0"} 7.0
online_opd_reloads_total{result="ok"} 2.0
online_opd_gate_tau{drafter="candidate",version="v2"} 3.5
online_opd_drafter_version NaN
online_opd_reload_duration_seconds_bucket{le="0.5"} 1.0
online_opd_reload_duration_seconds_bucket{le="+Inf"} 2.0
online_opd_reload_duration_seconds_count 2.0
online_opd_reload_duration_seconds_sum 0.75
"""


def test_parse_metrics_keys_do_not_depend_on_engines_model_name_or_label_order():
    two_engines = parse_metrics(EXPOSITION)
    version = two_engines.pop("online_opd_drafter_version")
    assert math.isnan(version)
    assert two_engines == {
        "vllm:spec_decode_num_drafts_total": 15.0,  # 10 + 5: engine 0 and engine 1 summed
        "vllm:spec_decode_num_accepted_tokens_per_pos_total{position=0}": 7.0,
        "online_opd_reloads_total{result=ok}": 2.0,
        "online_opd_gate_tau{drafter=candidate,version=v2}": 3.5,  # written version=, drafter=: sorted
        "online_opd_reload_duration_seconds_bucket{le=0.5}": 1.0,
        "online_opd_reload_duration_seconds_bucket{le=+Inf}": 2.0,
        "online_opd_reload_duration_seconds_count": 2.0,
        "online_opd_reload_duration_seconds_sum": 0.75,
    }
    one_engine = parse_metrics(ONE_ENGINE)  # the same figures from one engine of another model name
    assert math.isnan(one_engine.pop("online_opd_drafter_version"))
    assert one_engine == two_engines


def test_scrape_loop_skips_failures(tmp_path, monkeypatch):
    for var in ("http_proxy", "HTTP_PROXY", "all_proxy", "ALL_PROXY"):
        monkeypatch.delenv(var, raising=False)
    hits = []
    stop = threading.Event()

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 (http.server's name)
            hits.append(self.path)
            ok = len(hits) != 2  # the second scrape fails
            body = EXPOSITION.encode() if ok else b"oops"
            self.send_response(200 if ok else 500)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
            if len(hits) == 3:
                stop.set()  # stop by event, not by clock: the first scrape's imports take a while

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}/"
    out = tmp_path / "s" / "scrapes.jsonl"
    try:
        # a request timeout of its own: the default (the interval, 10 ms) starved this process's server
        # thread of the GIL while each failed scrape built a new client, and the loop never stopped (seen
        # once in a local run: 7 min at 100% CPU); and a duration, so that a failure ends the test
        summary = scrape_loop(url, out, interval_s=0.01, stop=stop, timeout=10.0, duration_s=120)
        once = scrape_loop(url, out, interval_s=60, duration_s=0)  # duration 0: one scrape, no wait
    finally:
        server.shutdown()
        server.server_close()
    assert hits == ["/metrics"] * 4
    assert (summary["scrapes"], summary["errors"]) == (2, 1) and (once["scrapes"], once["errors"]) == (1, 0)
    lines = [json.loads(line) for line in out.read_text().splitlines()]  # strict JSON: NaN became null
    assert len(lines) == 3  # appended, not overwritten
    assert lines[0]["metrics"]["vllm:spec_decode_num_drafts_total"] == 15.0
    assert lines[0]["metrics"]["online_opd_drafter_version"] is None
    assert lines[0]["time"] <= lines[1]["time"] <= lines[2]["time"]


def test_scrape_cli_parses():
    args = report_args("scrape", "--out", "x.jsonl", "--duration", "3")
    assert (args.url, args.interval, args.duration) == ("http://127.0.0.1:8000", 5.0, 3.0)


# ---------------------------------------------------------------- Grafana


def test_grafana_dashboard_queries_known_metrics():
    dashboard = json.loads((ROOT / "configs/grafana-online-opd.json").read_text())
    assert 36 <= dashboard["schemaVersion"] <= 41
    assert [i["name"] for i in dashboard["__inputs"]] == ["DS_PROMETHEUS"]
    exprs, cells = [], set()
    for panel in dashboard["panels"]:
        assert panel["title"] and panel["type"] in ("timeseries", "stat"), panel
        assert panel["targets"], panel["title"]
        g = panel["gridPos"]
        assert g["x"] + g["w"] <= 24 and g["w"] > 0 and g["h"] > 0, panel["title"]
        cell = {(x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])}
        assert not cell & cells, f"{panel['title']} overlaps another panel"
        cells |= cell
        for target in panel["targets"]:
            assert target["datasource"]["uid"] == "${DS_PROMETHEUS}"
            exprs.append(target["expr"])
    exprs += [a["expr"] for a in dashboard["annotations"]["list"] if "expr" in a]
    used = set()
    for expr in exprs:
        names = set(re.findall(r"\b(?:vllm:[a-z_:]+|online_opd_[a-z_]+)", expr))
        assert names, f"no known metric in {expr!r}"
        assert names <= KNOWN_METRICS, f"unknown metric {names - KNOWN_METRICS} in {expr!r}"
        used |= names
    assert used == KNOWN_METRICS  # every series of the brief has a panel
