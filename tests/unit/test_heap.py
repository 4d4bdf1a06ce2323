"""A process's start-up heap out of later collections (ops/runtime/heap.py)."""

from __future__ import annotations

import gc
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any


def test_freeze_heap_freezes_what_is_alive_and_collects_the_garbage_first() -> None:
    # In a process of its own: the test process's heap must stay collectable.
    code = textwrap.dedent("""
        import gc, weakref
        from joynexus.ops.runtime.heap import freeze_heap

        class Node:
            pass

        kept = [Node() for _ in range(1000)]
        cycle = Node(); cycle.me = cycle          # garbage only a collection finds
        gone = weakref.ref(cycle); del cycle
        before = gc.get_freeze_count()
        freeze_heap()
        assert gone() is None, "the garbage was frozen, not collected"
        assert gc.get_freeze_count() >= before + 1000, gc.get_freeze_count()
        assert all(gc.is_tracked(k) for k in kept)
        # A later full collection walks only what was made since.
        later = [Node() for _ in range(10)]
        assert len(gc.get_objects(generation=2)) < 1000, len(gc.get_objects(generation=2))
        cycle = Node(); cycle.me = cycle; gone = weakref.ref(cycle); del cycle
        gc.collect()
        assert gone() is None, "garbage made after the freeze is collected as before"
        print("ok", len(later))
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "ok 10"
    assert gc.get_freeze_count() == 0  # this process: untouched


def test_a_role_process_freezes_its_heap_once_it_is_ready(
    nats_server: Any, namespace: str, tmp_path: Path
) -> None:
    """``joynexus agent``'s runner (``run_agent``) hands ``freeze_heap`` to the role as
    its readiness hook: a real scheduler role, in a process of its own, frozen once
    it serves and not before."""
    code = textwrap.dedent(f"""
        import asyncio, gc
        from pathlib import Path
        import joynexus.ops.runtime.heap as heap
        from joynexus.ops.cli.agent import run_agent
        from joynexus.ops.runtime.roles import RoleOptions

        async def main():
            stop = asyncio.Event()
            seen = []
            real = heap.freeze_heap

            def ready():
                seen.append(gc.get_freeze_count())
                real()
                seen.append(gc.get_freeze_count())
                stop.set()

            heap.freeze_heap = ready
            opts = RoleOptions(instance="heap-test", data_dir=Path({str(tmp_path)!r}))
            await asyncio.wait_for(run_agent("scheduler", {nats_server.url!r}, {namespace!r},
                                             opts, stop), 60)
            print(seen[0], seen[1] > 10000)

        asyncio.run(main())
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["0", "True"], out.stdout
