"""The Grafana dashboard in examples/ queries only series the exporter really publishes.

Every metric name in every panel's PromQL must be one that a fully fed exporter (controller
events of every kind, a node with ranks, a real snapshot, updates and incidents) exposes: a
renamed metric breaks this test instead of leaving an empty panel in someone's Grafana.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from failslow.core.control.journal import event
from failslow.observe.metrics import ControlMetrics, NodeCollector, new_registry

DASHBOARD = Path(__file__).parents[2] / "examples" / "grafana-failslow.json"


def exported_names(tmp_path: Path) -> set[str]:
    import torch

    from failslow.core.checkpoint.snapshot import Snapshotter

    registry = new_registry()
    metrics = ControlMetrics(registry)
    metrics(event("state", state="diagnosed", detail={"healthy": False, "paused_s": 0.3}))
    metrics(event("onset", type="onset", rank=0))
    metrics(event("diagnosis", diagnosis={"kind": "both", "slow_ranks": [[1, 2.0]],
                                          "slow_links": [[0, 1, 3.0]]}))  # fmt: skip
    metrics(event("steps", steps=[[1, 0.1]]))
    plan = {"type": "MicroBatchPlan", "counts": [1], "weights": [1.0], "step_time_s": 0.1}
    metrics(event("plan", action="apply", strategy="S2", plan=plan, reason="", apply_step=2,
                  committed=True, detail="", in_effect=None))  # fmt: skip
    metrics(event("effect", action="apply", strategy="S2", plan=plan, apply_step=2,
                  state="in effect", detail="", in_effect=plan))  # fmt: skip
    metrics(event("outcome", action="apply", strategy="S2", plan=plan, apply_step=2, before_s=0.2,
                  predicted_s=0.1, measured_s=0.1, verdict="pays", reason=""))  # fmt: skip
    metrics(event("unavailable", strategy="S3", reason="no factory"))
    with Snapshotter(tmp_path, rank=0) as snap:
        snap.start({"w": torch.zeros(8)}, 1)
        snap.wait_sealed(10.0)
        state = {"rank": 0, "iterations": 3, "last_s": 0.1, "median_s": 0.1, "slow": True}
        registry.register(
            NodeCollector(
                rank_states=lambda: {0: state},
                snapshot_dir=tmp_path,
                updates=lambda: ["applied"],
                incidents=lambda: {"failed": 1},
            )
        )
        text = generate_latest(registry).decode()
    return {s.name for f in text_string_to_metric_families(text) for s in f.samples}


def test_every_panel_queries_published_series(tmp_path: Path) -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    names = exported_names(tmp_path)
    panels = dashboard["panels"]
    assert len({p["id"] for p in panels}) == len(panels)
    queried = set()
    for panel in panels:
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            queried |= set(re.findall(r"\bfailslow_[a-z_]+", target["expr"]))
    missing = sorted(queried - names)
    assert not missing, f"panels query series nobody exports: {missing}"
    # and the dashboard shows every family the exporter has (a new metric gets a panel)
    families = {re.sub(r"_(bucket|count|sum|created|total)$", "", n) for n in names}
    shown = {re.sub(r"_(bucket|count|sum|total)$", "", n) for n in queried}
    assert families - shown == set(), families - shown
