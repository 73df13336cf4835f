"""The benchmarks' interleaving helper (tools/bench_util.py): no GPU needed."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))

from bench_util import interleaved_us, median_spread  # noqa: E402


def test_interleaved_rounds_take_turns_and_report_sorted_times():
    order, clock = [], iter(range(100))

    def timer(name, slowdown):
        def run():
            order.append(name)
            return 10.0 * slowdown + next(clock)  # a clock that drifts upward over the job
        return run

    times = interleaved_us({"a": timer("a", 1), "b": timer("b", 2)}, rounds=3)
    assert order == ["a", "b"] * 3  # every variant once per round, in turn
    assert times == {"a": [10.0, 12.0, 14.0], "b": [21.0, 23.0, 25.0]}
    assert median_spread(times["a"]) == (12.0, 10.0, 14.0)
    # Timed one after the other (a, a, a, b, b, b) the drift would have added 3 to b alone.
    assert median_spread(times["b"])[0] - median_spread(times["a"])[0] == 11.0
