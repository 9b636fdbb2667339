"""The lookup plan (worker/lookup_plan.py): where each table's ids are in the features,
learned from a step's lookups; later steps pull every planned table in one call, and a
lookup uses prefetched rows only when its ids are exactly the prefetched ones."""

from __future__ import annotations

import numpy as np
import torch

from elasticdl.worker.lookup_plan import LookupPlan, Source, find_source


class Client:
    """Rows are the id repeated over ``dim`` (so a wrong row is visible); counts calls."""

    def __init__(self) -> None:
        self.calls: list[list[str]] = []

    def start_pull_embeddings(self, tables, create=True):
        self.calls.append([t for t, _, _, _ in tables])
        rows = [torch.from_numpy(ids).to(dtype).unsqueeze(1).repeat(1, dim)
                for _, ids, dim, dtype in tables]
        return lambda: rows


def _lookup(plan: LookupPlan, table: str, ids: torch.Tensor):
    uniq = np.unique(ids.reshape(-1).to(torch.int64).numpy())
    return plan.take(table, ids, uniq, 2, torch.float32), uniq


def test_sources_are_found_by_value_whole_or_as_columns():
    cat = torch.tensor([[5, 7], [6, 9]])
    x = torch.tensor([[0.5, 3.0, 8.0], [0.25, 4.0, 1.0]])   # DeepCTR: ids in float columns
    features = (torch.zeros(2, 3), {"cat": cat, "x": x})
    assert find_source(features, cat) == Source((1, "cat"))
    assert find_source(features, cat[:, 1].clone()) == Source((1, "cat"), 1, 2)
    assert find_source(features, x[:, 1:2].long()) == Source((1, "x"), 1, 2)
    assert find_source(features, torch.tensor([[1], [2]])) is None
    assert Source((1, "x"), 1, 3).ids(features).tolist() == [3, 8, 4, 1]
    assert Source((2,)).ids(features) is None


def test_planned_tables_come_in_one_call_and_wrong_ids_are_never_served():
    plan, client = LookupPlan(), Client()
    batches = [(torch.tensor([1, 2, 2]), torch.tensor([[3.0, 10.0], [4.0, 11.0]])),
               (torch.tensor([5, 1, 5]), torch.tensor([[6.0, 12.0], [7.0, 13.0]]))]
    # step 1: nothing planned yet; both tables are learned from their lookups
    plan.prefetch(batches[0], client, create=True)
    assert _lookup(plan, "a", batches[0][0])[0] is None
    assert _lookup(plan, "b", batches[0][1][:, 0:1].long())[0] is None
    plan.end_step()
    assert client.calls == []
    # step 2: one call for both, and each lookup gets its own ids' rows
    plan.prefetch(batches[1], client, create=True)
    rows_a, uniq_a = _lookup(plan, "a", batches[1][0])
    rows_b, uniq_b = _lookup(plan, "b", batches[1][1][:, 0:1].long())
    plan.end_step()
    assert client.calls == [["a", "b"]]
    assert rows_a[:, 0].tolist() == uniq_a.tolist() == [1, 5]
    assert rows_b[:, 0].tolist() == uniq_b.tolist() == [6, 7]
    assert (plan.hits, plan.misses) == (2, 0)
    # step 3: the model looks "b" up with other ids than planned: it pulls its own and
    # "b" leaves the plan; "a" is not looked up at all: it leaves the plan too
    plan.prefetch(batches[0], client, create=True)
    assert _lookup(plan, "b", batches[0][1][:, 1:2].long())[0] is None
    plan.end_step()
    assert (plan.hits, plan.misses) == (2, 1)
    assert plan.plan == {}


def test_a_failed_prefetch_surfaces_in_the_lookup_and_the_next_step_starts_clean():
    plan = LookupPlan()

    class Failing(Client):
        def start_pull_embeddings(self, tables, create=True):
            def wait():
                raise ConnectionError("PS 1 gone")
            return wait

    ids = torch.tensor([3, 4])
    plan.prefetch((ids,), Client(), create=True)
    _lookup(plan, "a", ids)
    plan.end_step()
    plan.prefetch((ids,), Failing(), create=True)
    try:
        _lookup(plan, "a", ids)
        raise AssertionError("the failed pull was not raised")
    except ConnectionError:
        pass
    plan.end_step()
    assert not plan.started
    plan.prefetch((ids,), Client(), create=False)
    got, uniq = _lookup(plan, "a", ids)
    assert got[:, 0].tolist() == uniq.tolist() == [3, 4]


def test_a_table_of_computed_ids_is_searched_for_a_few_steps_only(monkeypatch):
    """torchfm adds field offsets to the features: its ids are in no feature tensor; the
    search (up to MAX_COLUMNS equality checks a 2-D tensor) stops after MAX_LEARN steps."""
    from elasticdl.worker import lookup_plan

    searched = []
    real = lookup_plan.find_source
    monkeypatch.setattr(lookup_plan, "find_source",
                        lambda f, ids: searched.append(1) or real(f, ids))
    plan, x = LookupPlan(), torch.tensor([[1, 2], [3, 4]])
    for _ in range(10):
        plan.prefetch((x,), Client(), create=True)
        assert _lookup(plan, "fm", x + 100)[0] is None
        plan.end_step()
    assert len(searched) == lookup_plan.MAX_LEARN and plan.plan == {}
