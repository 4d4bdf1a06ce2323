"""Each tenant's share of the trainer against its weighted fair share, as ``status``
shows it (the scheduler snapshot's ``shares``; see docs/ARCHITECTURE.md, "Fair
shares of the trainer")."""

from __future__ import annotations

from typing import Any

HEADER = ["tenant", "weight", "share", "fair share", "trainer s", "queued reserves"]
TITLE = ("Trainer shares (rows trained, decayed over the last minutes, against the weighted "
         "fair share; queued: reserves waiting for admission)")


def share_rows(sched: dict[str, Any]) -> list[list[Any]]:
    """The table's rows: one per tenant with work under way, waiting, or trained lately."""
    return [
        [s["tenant_id"], s.get("weight", 1), f"{100 * s.get('share', 0.0):.1f}%",
         f"{100 * s.get('fair_share', 0.0):.1f}%", f"{s.get('trainer_s', 0.0):.1f}",
         s.get("queued", 0)]
        for s in sched.get("shares", [])
    ]
