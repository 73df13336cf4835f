"""tools/bench_transformers.py's method on the CPU: how compare() orders and pairs its rounds."""
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tools"))

pytest.importorskip("transformers")
import bench_transformers  # noqa: E402


class Model:
    def state_dict(self):
        return {}


@pytest.mark.parametrize("impls", [("sdpa", "jitattn"), ("sdpa", "jitattn", "jitattn:host_read")])
def test_compare_alternates_which_implementation_runs_first_and_pairs_each_round(impls):
    """ABBA: no implementation runs first (or last) in every round, and each round's ratio is
    taken against sdpa's rate of the same round."""
    order, made = [], []
    rates = {"sdpa": [100.0, 50.0, 100.0, 50.0], "jitattn": [110.0, 40.0, 90.0, 60.0],
             "jitattn:host_read": [100.0, 50.0, 100.0, 50.0]}

    def make(name, state):  # built in impls' order ("jitattn:host_read" builds a "jitattn" model)
        made.append(Model())
        return made[-1]

    def case(model):
        impl = impls[made.index(model)]
        order.append(impl)
        return rates[impl][order.count(impl) - 1]

    medians, ratios, cpu_ratios = bench_transformers.compare(make, case, impls, rounds=4)
    rounds = [order[i:i + len(impls)] for i in range(0, len(order), len(impls))]
    assert rounds == [list(impls), list(impls[::-1])] * 2
    assert ratios["jitattn"] == sorted([1.1, 0.8, 0.9, 1.2])  # per round, not of the medians
    assert ratios["sdpa"] == [1.0] * 4 and cpu_ratios["jitattn"] == []
    assert medians["jitattn"] == 75.0
