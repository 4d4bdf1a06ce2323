"""A blocking facade over :class:`joynexus.sdk.Client` for scripts and notebooks.

It runs the async client on an event loop in a background thread; every
method returns a ``concurrent.futures.Future`` (call ``.result()``), and
``events()`` is a plain iterator.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import queue
import threading
from collections.abc import Awaitable, Iterator
from pathlib import Path
from typing import Any, TypeVar

from joynexus.schemas.jobs import JobEvent
from joynexus.sdk.client import Client, Credentials

T = TypeVar("T")
_END = object()

#: Methods of Client that return futures; SyncClient offers each with a
#: concurrent.futures.Future (call .result()).
FUTURE_METHODS = frozenset(
    {
        "create_workload",
        "get_workload",
        "list_workloads",
        "cancel_workload",
        "submit_sft_batch",
        "submit_rollout",
        "latest_version",
        "evaluate",
        "export",
        "act",
        "usage",
    }
)


class SyncClient:
    def __init__(
        self, client: Client, loop: asyncio.AbstractEventLoop, thread: threading.Thread
    ) -> None:
        self._client = client
        self._loop = loop
        self._thread = thread
        self.tenant = client.tenant

    @classmethod
    def connect(
        cls,
        url: str | list[str] | None = None,
        *,
        tenant: str | None = None,
        credentials: Credentials | str | Path | None = None,
        namespace: str | None = None,
    ) -> SyncClient:
        """Same arguments as :meth:`Client.connect`."""
        loop = asyncio.new_event_loop()
        thread = threading.Thread(
            target=loop.run_forever, name=f"joynexus-sdk-{tenant or 'tenant'}", daemon=True
        )
        thread.start()
        fut = asyncio.run_coroutine_threadsafe(
            Client.connect(url, tenant=tenant, credentials=credentials, namespace=namespace), loop
        )
        try:
            client = fut.result()
        except BaseException:
            loop.call_soon_threadsafe(loop.stop)
            raise
        return cls(client, loop, thread)

    def _run(self, make: Any) -> concurrent.futures.Future[Any]:
        async def go() -> Any:
            return await make()

        return asyncio.run_coroutine_threadsafe(go(), self._loop)

    def __getattr__(self, name: str) -> Any:
        """The async client's future-returning methods, as blocking-future ones."""
        if name not in FUTURE_METHODS:
            raise AttributeError(f"SyncClient has no attribute {name!r}")
        fn = getattr(self._client, name)

        def call(*args: Any, **kw: Any) -> concurrent.futures.Future[Any]:
            # fn must run on the client's loop (it schedules a task there).
            return self._run(lambda: _awaitable(fn(*args, **kw)))

        call.__doc__ = fn.__doc__
        return call

    def __dir__(self) -> list[str]:
        return sorted({*super().__dir__(), *FUTURE_METHODS})

    def training_client(self, workload: str) -> SyncTrainingClient:
        """A blocking-future facade over ``Client.training_client(workload)``: each
        call returns a ``concurrent.futures.Future`` at once (``.result()``), in order."""
        tc = self._run(lambda: self._client.training_client(workload)).result()
        return SyncTrainingClient(self, tc)

    def events(
        self, workload: str | None = None, *, timeout_s: float | None = None
    ) -> Iterator[JobEvent]:
        """Job events as a blocking iterator; stops after ``timeout_s`` without an event."""
        q: queue.Queue[Any] = queue.Queue()

        async def pump() -> None:
            try:
                async for ev in self._client.events(workload):
                    q.put(ev)
            finally:
                q.put(_END)

        fut = asyncio.run_coroutine_threadsafe(pump(), self._loop)
        try:
            while True:
                try:
                    item = q.get(timeout=timeout_s)
                except queue.Empty:
                    return
                if item is _END:
                    return
                yield item
        finally:
            fut.cancel()

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self._client.close(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)

    def __enter__(self) -> SyncClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


async def _awaitable(x: Awaitable[T]) -> T:
    return await x


class SyncTrainingClient:
    """The training client's calls as blocking futures (see ``SyncClient.training_client``)."""

    CALLS = frozenset({"forward", "forward_backward", "forward_backward_custom", "optim_step",
                       "zero_grad", "save_state", "load_state", "list_states", "delete_state"})

    def __init__(self, sync: SyncClient, tc: Any) -> None:
        self._sync = sync
        self._tc = tc

    def __getattr__(self, name: str) -> Any:
        if name not in self.CALLS:
            raise AttributeError(f"SyncTrainingClient has no attribute {name!r}")
        fn = getattr(self._tc, name)

        def call(*args: Any, **kw: Any) -> concurrent.futures.Future[Any]:
            # Made on the client's loop in call order (the calls apply in that order).
            return self._sync._run(lambda: _awaitable(fn(*args, **kw)))

        call.__doc__ = fn.__doc__
        return call

    def __dir__(self) -> list[str]:
        return sorted({*super().__dir__(), *self.CALLS})

