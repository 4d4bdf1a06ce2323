"""Which connections the cap closes (ops/runtime/conncap.py), as a table: per capped
user the newest beyond its cap; users without a cap (the service's) never."""

from __future__ import annotations

import pytest

from joynexus.broker.subjects import Names
from joynexus.ops.runtime.conncap import Capped, Conn, over_cap

CAPS = {"jnx.acme": Capped(Names("jnx"), "acme", 2), "jnx.bolt": Capped(Names("jnx"), "bolt", 1)}


def c(user: str, cid: int, start: str = "t0", server: str = "S1") -> Conn:
    return Conn(server, cid, user, start)


@pytest.mark.parametrize(
    ("conns", "want"),
    [
        ([], []),
        # within the cap: nothing
        ([c("jnx.acme", 1), c("jnx.acme", 2)], []),
        # the newest beyond it, by start time (then server, then id)
        ([c("jnx.acme", 9, "t1"), c("jnx.acme", 3, "t2"), c("jnx.acme", 5, "t0")],
         [c("jnx.acme", 3, "t2")]),
        ([c("jnx.acme", 1), c("jnx.acme", 2), c("jnx.acme", 3), c("jnx.acme", 4)],
         [c("jnx.acme", 3), c("jnx.acme", 4)]),
        # each user on its own; several servers counted together
        ([c("jnx.bolt", 1, server="S2"), c("jnx.bolt", 1, server="S1"), c("jnx.acme", 7)],
         [c("jnx.bolt", 1, server="S2")]),
        # users without a cap (the service, the admin) are never closed
        ([c("jnx-service", i) for i in range(50)], []),
    ],
)
def test_over_cap(conns: list[Conn], want: list[Conn]) -> None:
    assert over_cap(conns, CAPS) == want
