"""Observability where training people already look (DESIGN.md, ``observe/``).

- :mod:`.metrics`: Prometheus metrics of the controller and each node publisher, on an opt-in
  port (``failslow run --metrics-port``, config ``observe.metrics_port``);
- :mod:`.notifiers`: TensorBoard and W&B notifiers, built-in plugins enabled by config;
- :mod:`.report`: ``failslow report RUN_DIR`` - one self-contained HTML file for a run;
- :mod:`.top`: ``failslow top --store URL`` - a live terminal view of a running job.

Every view reads the same records: the control plane's events (:mod:`failslow.core.control.journal`:
``events.jsonl`` in a run's log directory, ``failslow/status`` in the store) and what the nodes
publish (:mod:`failslow.node.publisher`).
"""
