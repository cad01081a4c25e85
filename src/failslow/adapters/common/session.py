"""Starting an adapter's session: every adapter's ``attach`` does these steps the same way.

The settings come from the framework's config block, ``config=`` or the environment
(:func:`failslow.config.as_config`: a misspelt key is one line naming it); the adapter is
registered as the session's plugin, the session starts (capture, control agent, snapshots and
resume), and the adapter's micro-batch split asks the session for the plans decided ahead of
its loaders (:meth:`~failslow.adapters.common.microbatch.ReplicaSplit.bind`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from failslow.config import FailslowConfig, as_config
from failslow.runtime.session import Session


def start_session(
    adapter: Any,
    settings: FailslowConfig | Mapping[str, Any] | None,
    *,
    source: str,
    name: str,
) -> Session:
    """Register ``adapter`` (it has ``session`` and ``split`` attributes) on a new session built
    from ``settings`` (errors name ``source``), start it and return it."""
    session = Session(as_config(settings, source))
    session.register(adapter, name=name)
    adapter.session = session.start()
    adapter.split.bind(session.plans_for_data, lambda: (session.first_step, session.step))
    return session
