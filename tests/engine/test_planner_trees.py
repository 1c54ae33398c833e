"""The planner shapes decisions into token trees: the request's or the replica's budget, the floor
from the cost model, none for rows that may not verify a tree, all within the KV room."""

from __future__ import annotations

from policies import Decision, FittedCostModel, PolicyConfig, create_policy
from serve_app.engine.planner import PlannedRequest, SpeculationPlanner


def planned(rid: str, *, tree_nodes: int | None = None, tree_row: bool = True, room: int = 100):
    return PlannedRequest(rid, 20, 0, 50, 0.0, "draft", None, room, tree_nodes=tree_nodes, tree_row=tree_row)


def planner(cost: FittedCostModel, trees: dict[str, int]) -> SpeculationPlanner:
    policy = create_policy("static", PolicyConfig("draft", 4, 8))
    out = SpeculationPlanner(policy, ["draft", "ngram"], 8, "draft", cost=cost, trees=trees)
    for rid in "abcd":
        out.admit(rid, "def f(x):")
    return out


def test_budgets_come_from_the_request_else_the_replica() -> None:
    flat = FittedCostModel(target=(0.1, 0.0, 0.0, 0.0), knee=16, draft={"draft": (0.01, 0.0, 0.0)})
    rows = [planned("a"), planned("b", tree_nodes=2), planned("c", tree_nodes=0),
            planned("d", tree_row=False)]  # fmt: skip
    decisions = planner(flat, {"draft": 4}).decide(rows, 0)
    assert [d.nodes for d in decisions] == [4, 2, 0, 0]
    assert all(d.depth == 4 and d.proposer == "draft" for d in decisions)
    assert decisions[0].min_score == 0.0  # a flat forward: every alternative earns its row
    no_budget = planner(flat, {}).decide([planned("a"), planned("b", tree_nodes=3)], 0)
    assert [d.nodes for d in no_budget] == [0, 3]


def test_a_dear_verify_sets_a_floor_and_the_room_cuts_alternatives_first() -> None:
    dear = FittedCostModel(target=(0.1, 0.02, 0.0, 0.0), knee=1, draft={"draft": (0.01, 0.0, 0.0)})
    [tree, tight, tighter] = planner(dear, {"draft": 4}).decide(
        [planned("a"), planned("b", room=6), planned("c", room=3)], 0
    )
    assert 0.0 < tree.min_score < 1.0
    assert (tight.depth, tight.nodes) == (4, 2) and (tighter.depth, tighter.nodes) == (3, 0)
    assert tighter == Decision("draft", 3, 0, tighter.min_score)
