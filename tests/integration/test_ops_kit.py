"""The deployment kit's files say what the gateway does: every metric the Grafana dashboard
queries is exported, the scrape config and the systemd unit are well-formed.  (HAProxy's
config is rendered and checked with `haproxy -c` by ops/cluster.sh in test_cluster.py.)"""

from __future__ import annotations

import configparser
import json
import re
from pathlib import Path

import httpx
import yaml

OPS = Path(__file__).resolve().parents[2] / "ops"


def test_every_dashboard_metric_is_exported(gateway):
    exported = httpx.get(gateway.base + "/metrics").text
    dashboard = json.loads((OPS / "grafana-dashboard.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    names = {re.sub(r"_bucket$", "", n) for e in exprs for n in re.findall(r"specgate_[a-z_]+", e)}
    assert len(names) >= 12
    for name in sorted(names):
        assert f"# TYPE {name}" in exported or f"# TYPE {name.removesuffix('_total')}" in exported \
            or f"\n{name} " in exported, name


def test_scrape_config_and_systemd_unit_are_well_formed():
    scrape = yaml.safe_load((OPS / "prometheus.yml").read_text())
    job = scrape["scrape_configs"][0]
    assert job["metrics_path"] == "/metrics" and job["static_configs"][0]["targets"]
    unit = configparser.ConfigParser(strict=False, interpolation=None)
    unit.read_string((OPS / "specgate@.service").read_text())
    assert "specgate serve" in unit["Service"]["ExecStart"] and "%i" in unit["Service"]["ExecStart"]
    assert unit["Service"]["KillSignal"] == "SIGTERM" and int(unit["Service"]["TimeoutStopSec"]) > 30
