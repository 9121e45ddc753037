"""The dashboard's part of flowreduce's scheduler extension (alone in its
place after ``--preload`` or :func:`flowreduce.dashboard.install`, until the
extension adopts it): the store (:mod:`flowreduce.dashboard.store`) and,
where bokeh is installed, the page (:mod:`flowreduce.dashboard.page`) it feeds."""

from __future__ import annotations

import logging
from typing import Any

from flowreduce.dashboard.store import DashboardStore

logger = logging.getLogger("flowreduce.dashboard")


class DashboardPlugin(DashboardStore):
    """:class:`DashboardStore` that also serves the ``/flowreduce`` page."""

    async def start(self, scheduler: Any) -> None:
        await super().start(scheduler)
        try:
            from flowreduce.dashboard import page
        except ImportError as e:  # no bokeh (or one distributed does not support): record, serve nothing
            logger.info("flowreduce dashboard page not served (%s); pip install flowreduce[viz]", e)
            return
        page.serve(scheduler)
