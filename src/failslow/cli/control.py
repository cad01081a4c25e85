"""``failslow controller``, ``node`` and ``config``: the job's control plane, one node's
publisher (greyhound 4.1) and the effective settings."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any


def _until_signalled() -> Any:
    """A stop() predicate that turns true on SIGINT or SIGTERM."""
    import signal
    import threading

    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    return stop.is_set


def _config_from_args(args: argparse.Namespace, **shortcuts: Any) -> Any:
    """FailslowConfig from ``--config FILE`` (JSON: a DeepSpeed config's ``"failslow"`` block or
    failslow's own settings), the environment, ``--set KEY=VALUE`` and option shortcuts."""
    from failslow.config import load_config, load_settings_file
    from failslow.errors import ConfigError

    data, source = None, "failslow config"
    if getattr(args, "config", None):
        data, source = load_settings_file(args.config)
    overrides = {k: v for k, v in shortcuts.items() if v is not None}
    for item in getattr(args, "set", None) or []:
        key, sep, value = item.partition("=")
        if not sep:
            raise ConfigError(f"--set {item!r}: expected KEY=VALUE, e.g. detection.threshold=1.2")
        overrides[key.strip()] = value
    return load_config(data, source=source, overrides=overrides)


def _cmd_controller(args: argparse.Namespace) -> int:
    from failslow.core.control.control_plane import ControlPlane
    from failslow.core.control.store import open_store
    from failslow.plugins import plugin_manager

    config = _config_from_args(
        args,
        **{
            "detection.threshold": args.threshold,
            "validation.link_mb": args.link_mb,
            "job_token": args.job_token,
            "observe.metrics_port": args.metrics_port,
        },
    )
    store = open_store(args.store)  # unreachable: StoreUnavailable -> one line, exit 2
    print(f"failslow controller: {args.world_size} ranks, store {store.url}", flush=True)
    observers, server = [], None
    if config.observe.metrics_port is not None:
        from failslow.observe.metrics import ControlMetrics, MetricsServer, new_registry

        registry = new_registry()
        observers.append(ControlMetrics(registry))
        server = MetricsServer(
            registry, port=config.observe.metrics_port, addr=config.observe.metrics_addr
        ).start()
        print(f"failslow controller: metrics on {server.url}", flush=True)
    plane = ControlPlane(
        store,
        config,
        world_size=args.world_size,
        log_dir=Path(args.log_dir) if args.log_dir else None,
        hooks=plugin_manager().hook,
        on_diagnosis=lambda d: print(d.to_json(), flush=True),
        observers=observers,
    ).start()
    stop = _until_signalled()
    import time

    try:
        while not stop():
            time.sleep(0.2)
    finally:
        plane.stop()
        if server is not None:
            server.stop()
    return 0


def _config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", help="JSON settings, or a DeepSpeed config with a failslow block")
    p.add_argument("--set", action="append", metavar="KEY=VALUE", help="e.g. planner.min_gain=0.1")


def _cmd_config(args: argparse.Namespace) -> int:
    settings = _config_from_args(args).to_dict()
    if settings.get("job_token"):
        settings["job_token"] = "***"  # a secret
    print(json.dumps(settings, indent=2))
    return 0


def _cmd_node(args: argparse.Namespace) -> int:

    from failslow.core.control.resilient import ResilientStore
    from failslow.core.tracking.analyzer import LocalAnalyzer
    from failslow.node.publisher import NodePublisher

    publisher = NodePublisher(LocalAnalyzer(Path(args.ring_dir)), ResilientStore(args.store))
    server = None
    if args.metrics_port is not None:
        from failslow.observe.metrics import MetricsServer, NodeCollector, new_registry

        registry = new_registry()
        registry.register(NodeCollector(rank_states=lambda: publisher.latest_states))
        server = MetricsServer(registry, port=args.metrics_port, addr=args.metrics_addr).start()
        print(f"failslow node: metrics on {server.url}", flush=True)
    stop = _until_signalled()
    print(f"failslow node: {args.ring_dir} -> {args.store}", flush=True)
    try:
        publisher.run(stop, args.poll_s)
    finally:
        if server is not None:
            server.stop()
    return 0


def register(sub: Any) -> None:
    p = sub.add_parser("controller", help="run the job's controller (profiling, validation)")
    p.add_argument("--store", required=True, help="tcp://HOST:PORT or redis://HOST:PORT/DB")
    p.add_argument("--world-size", type=int, required=True)
    p.add_argument("--log-dir", help="where diagnosis-<n>.json files go")
    p.add_argument("--threshold", type=float, help="slow when > x peers' median (1.1)")
    p.add_argument("--link-mb", type=int, help="link-test message size (MB, 16)")
    p.add_argument(
        "--job-token", help="the job's token the ranks hold (default: $FAILSLOW_JOB_TOKEN)"
    )
    p.add_argument(
        "--metrics-port", type=int, metavar="PORT",
        help="serve Prometheus metrics on 127.0.0.1:PORT (0: a free port; observe.metrics_addr "
        "to bind elsewhere)",
    )  # fmt: skip
    _config_args(p)
    p.set_defaults(func=_cmd_controller)

    p = sub.add_parser("config", help="print the effective settings (defaults, file, env, --set)")
    _config_args(p)
    p.set_defaults(func=_cmd_config)

    p = sub.add_parser("node", help="publish this node's onsets and group summaries")
    p.add_argument("--store", required=True, help="tcp://HOST:PORT or redis://HOST:PORT/DB")
    p.add_argument("--ring-dir", required=True)
    p.add_argument("--poll-s", type=float, default=0.1)
    p.add_argument("--metrics-port", type=int, metavar="PORT", help="serve Prometheus metrics")
    p.add_argument("--metrics-addr", default="127.0.0.1", help="its address (127.0.0.1)")
    p.set_defaults(func=_cmd_node)
