"""The books a node keeps of its peers have a bound on their rows, and what they forget
costs the honest sites nothing.

The credit nets, the sink scores and the weight exchanged keep ``rows`` peers: BOOK_ROWS
(1,024) in the daemon and in a simulated mesh no larger, SIM_BOOK_ROWS in a larger one,
whose nodes meet a new peer at nearly every push and whose rows were a third of a node's
memory. The credit forgets the net nearest 0, so a sink holding its credit and an
inflater that brought its most are the last to go; the sink watch its lowest score
(tests/test_sink_book.py); the exchanged book is an account and forgets a peer out of
the view first.
"""

from __future__ import annotations

import pytest

from gossipd.node.protocols.credit import DEFAULT_CREDIT, FOUNDING_WEIGHT, PeerCredit
from gossipd.node.protocols.exchanged import ExchangedBook
from gossipd.node.protocols.settings import BOOK_ROWS, SIM_BOOK_ROWS
from gossipd.node.sim.driver import Simulation
from gossipd.node.sim.spec import SimSpec

TAKE = DEFAULT_CREDIT
BRING = TAKE + FOUNDING_WEIGHT


def test_a_full_credit_book_forgets_the_nets_nearest_zero_not_a_sinks_or_an_inflaters() -> None:
    credit = PeerCredit(TAKE, 1, rows=4)
    credit.sent("sink", 0, TAKE)  # holds all the credit of this node's weight
    credit.received("inflater", 0, BRING)  # brought all it may
    credit.sent("a", 0, 0.2)
    credit.received("b", 0, 0.1)
    credit.sent("c", 0, 0.05)  # a fifth peer: the half of the four nearest 0 goes first
    assert set(credit.nets[0]) == {"sink", "inflater", "c"}
    for i in range(100):  # a hundred more peers, each met once
        credit.sent(f"new-{i}", 0, 0.01 * (i % 7 + 1))
    assert {"sink", "inflater"} <= set(credit.nets[0]) and len(credit.nets[0]) <= 4
    assert credit.room("sink", 0, 0.0) == 0.0  # nothing more goes to it
    with pytest.raises(Exception, match="more than it may bring"):
        credit.check("inflater", 0, 1e-3, 0.0)


def test_a_credit_book_restored_with_more_rows_than_it_keeps_shrinks_at_once() -> None:
    big = PeerCredit(TAKE, 1)
    for i in range(20):
        big.sent(f"p{i}", 0, 0.01 * (i + 1))
    small = PeerCredit(TAKE, 1, rows=5)
    small.restore(big.state())
    small.sent("newcomer", 0, 0.3)
    assert set(small.nets[0]) == {"p18", "p19", "newcomer"}  # the largest two, and it
    with pytest.raises(ValueError, match="at least 1 row"):
        PeerCredit(TAKE, 1, rows=0)


def test_the_exchanged_book_forgets_peers_out_of_the_view_first_then_the_oldest() -> None:
    book = ExchangedBook(rows=3)
    for peer in ("old", "member", "gone"):
        book.add(peer, sent=1.0, received=0.5)
    book.add("new", sent=2.0, members={"old", "member", "new"})
    assert set(book.sent) == {"member", "new"}  # "gone" was out of the view, "old" oldest
    book.add("newer", sent=1.0, members=set())
    assert set(book.sent) == {"member", "new", "newer"}
    restored = ExchangedBook.restore(book.state(), rows=3)
    assert restored.rows == 3 and restored.by_peer == book.by_peer


def test_a_simulated_mesh_larger_than_the_books_keeps_a_few_rows_and_refuses_no_one() -> None:
    """Each node meets several times the rows it keeps; at this scale a peer is hardly met
    twice, so no honest push is refused (a net forgotten at one end only can get one
    refused where peers meet again and again: the module's text), Σw stays exact, and it
    mixes as with every row kept."""
    nodes = BOOK_ROWS + 76
    spec = SimSpec(protocol="crossover", nodes=nodes, rounds=12, segments=2, dim=4)
    sim = Simulation(SimSpec(**{**spec.__dict__, "check_invariants": True}))
    result = sim.run()
    assert result.refused == 0
    assert result.invariant_mass_error is not None and result.invariant_mass_error <= 1e-12
    assert result.errors[-1] < 0.05 * result.errors[0]
    for node in sim.nodes:
        core = node.core
        assert all(len(nets) <= SIM_BOOK_ROWS for nets in core.credit.nets)
        assert len(core.exchanged.sent) <= SIM_BOOK_ROWS
        assert len(core.exchanged.received) <= SIM_BOOK_ROWS
        assert len(core.sinks.scores) <= SIM_BOOK_ROWS and not core.sinks.sinks()
        assert core.sinks.floor < core.sinks.bound / 4
    # Each node pushed to a new peer at nearly every push (and was pushed to as often).
    assert result.messages / nodes > 2 * SIM_BOOK_ROWS, "no node met more peers than its books"


def test_a_simulated_mesh_the_size_of_a_federation_keeps_every_peer() -> None:
    spec = SimSpec(protocol="sumweight", nodes=24, rounds=60, segments=2, dim=4)
    sim = Simulation(spec)
    assert sim.run().refused == 0
    assert all(node.core.credit.rows == BOOK_ROWS for node in sim.nodes)
    assert max(len(node.core.credit.nets[0]) for node in sim.nodes) > SIM_BOOK_ROWS
