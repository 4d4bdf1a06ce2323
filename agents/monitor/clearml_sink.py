"""The ClearML sink: one task per monitor run, online or as an offline session.

Reporting must never stop monitoring, and nothing may need a network: without
a configured server the task runs offline and leaves a session on disk
(``offline.read_offline_scalars`` reads it back). See docs/ARCHITECTURE.md,
"Traces and monitoring".
"""

from __future__ import annotations

import contextlib
import logging
import os
from pathlib import Path
from typing import Any

from joynexus.agents.monitor.aggregates import Scalar

log = logging.getLogger(__name__)


def clearml_server_configured() -> bool:
    """A ClearML server is configured: ``CLEARML_API_HOST``, or a clearml.conf file
    (``CLEARML_CONFIG_FILE``, ``~/clearml.conf``); ``CLEARML_OFFLINE_MODE=1`` forces offline."""
    if os.environ.get("CLEARML_OFFLINE_MODE", "").lower() in ("1", "true", "yes", "on"):
        return False
    if os.environ.get("CLEARML_API_HOST") or os.environ.get("TRAINS_API_HOST"):
        return True
    conf = os.environ.get("CLEARML_CONFIG_FILE")
    candidates = [Path(conf)] if conf else [Path("~/clearml.conf"), Path("~/.clearml.conf")]
    return any(p.expanduser().is_file() for p in candidates)


class ClearMLSink:
    """One ClearML task: created by ``start`` and closed by ``close`` (both block:
    call them in a worker thread); ``report`` only queues."""

    def __init__(
        self,
        *,
        project: str,
        task_name: str,
        cache_dir: Path,
        offline: bool | None = None,
    ) -> None:
        self.project = project
        self.task_name = task_name
        self.cache_dir = Path(cache_dir)
        self.offline = (not clearml_server_configured()) if offline is None else offline
        self.task: Any = None
        self.task_id: str | None = None
        self.session_dir: Path | None = None
        self.reported = 0

    @property
    def session_zip(self) -> Path | None:
        return self.session_dir.with_suffix(".zip") if self.session_dir else None

    def start(self) -> None:
        try:
            from clearml import Task
        except ImportError:
            log.warning("clearml is not installed (`pip install clearml`); metrics stay local")
            return
        # A forked reporter subprocess would inherit the NATS socket and make close wait
        # ~10 s; a reporter thread is enough for a few scalars per second.
        Task._report_subprocess_enabled = False  # type: ignore[assignment]
        prev_cache = os.environ.get("CLEARML_CACHE_DIR")
        if self.offline:
            # Before Task.init: the task then never contacts a server.
            Task.set_offline(offline_mode=True)
            self.cache_dir.mkdir(parents=True, exist_ok=True)
            os.environ["CLEARML_CACHE_DIR"] = str(self.cache_dir)
        try:
            # Called from a worker thread, Task.init cannot take over the process's
            # signal handlers (it would replace the agent's graceful SIGTERM stop).
            self.task = Task.init(
                project_name=self.project,
                task_name=self.task_name,
                task_type=Task.TaskTypes.monitor,
                reuse_last_task_id=False,
                auto_connect_frameworks=False,
                auto_connect_arg_parser=False,
                auto_resource_monitoring=False,
                auto_connect_streams=False,
            )
            self.task_id = self.task.id
            if self.offline:
                folder = self.task.get_offline_mode_folder()
                self.session_dir = Path(folder) if folder else None
        finally:
            if self.offline:
                if prev_cache is None:
                    os.environ.pop("CLEARML_CACHE_DIR", None)
                else:
                    os.environ["CLEARML_CACHE_DIR"] = prev_cache

    def report(self, scalars: list[Scalar]) -> None:
        if self.task is None:
            return
        logger = self.task.get_logger()
        for s in scalars:
            logger.report_scalar(s.title, s.series, value=s.value, iteration=s.iteration)
        self.reported += len(scalars)

    def close(self) -> None:
        if self.task is None:
            return
        task, self.task = self.task, None
        try:
            task.flush(wait_for_uploads=True)
        finally:
            task.close()
        if self.offline:
            with contextlib.suppress(Exception):
                from clearml import Task

                Task.set_offline(offline_mode=False)
        if self.session_zip:
            log.info("ClearML offline session: %s", self.session_zip)

    def info(self) -> dict[str, Any]:
        return {
            "offline": self.offline,
            "task_id": self.task_id,
            "session_dir": str(self.session_dir) if self.session_dir else None,
            "session_zip": str(self.session_zip) if self.session_zip else None,
            "reported": self.reported,
        }
