"""The throughput A/B (training.paired_throughput) on a synthetic clock with a known answer: one model exactly
k times slower, a neighbour's load that changes between rounds and within them."""

import random

import pytest

from diff_transformer.training.paired_throughput import median_interval, paired_throughput

K = 1.1  # A takes 1.1x B's time per step: A's throughput over B's is 1/1.1


class SharedMachine:
    """A clock that advances by each step's work times the load of the moment; ``load()`` says what it is."""

    def __init__(self, load):
        self.now = 0.0
        self.load = load

    def clock(self) -> float:
        return self.now

    def step(self, work: float):
        return lambda: setattr(self, "now", self.now + work * self.load())


def test_median_interval_coverage_by_order_statistics():
    assert median_interval(range(12)) == (2, 9)  # 3rd and 10th of 12: P(Binomial(12, 1/2) <= 2) = 1.9%
    assert median_interval(range(6)) == (0, 5)
    assert median_interval(range(5)) is None  # 2 x 1/32 = 6% > 5%: no 95% interval from 5 values


@pytest.mark.parametrize("seed", range(3))
def test_a_load_that_changes_between_rounds_does_not_move_the_ratio(seed):
    """The load jumps between 1x and 8x from one round to the next, as neighbours come and go: both windows of a
    round see the same load, so the estimate is exact (two runs made at different times would see different loads)."""
    rng = random.Random(seed)
    steps, rounds = 2, 12
    loads = [rng.uniform(1, 8) for _ in range(rounds)]
    calls = [0]

    def round_load():
        load = loads[calls[0] // (2 * steps)]  # a round is a window of each model
        calls[0] += 1
        return load

    machine = SharedMachine(round_load)
    result = paired_throughput(machine.step(K), machine.step(1.0), rounds=rounds, steps=steps, warmup=0,
                               clock=machine.clock)
    assert result.ratio == pytest.approx(1 / K, rel=1e-9)
    assert result.interval == pytest.approx((1 / K, 1 / K)) and not result.noisy
    assert max(loads) / min(loads) > 2  # the load did change, several-fold


def test_a_load_that_changes_within_rounds_is_flagged_and_a_steady_one_is_not():
    rng = random.Random(0)
    jittery = SharedMachine(lambda: rng.uniform(0.99, 1.01))  # ±1% from step to step: the ratio holds
    result = paired_throughput(jittery.step(K), jittery.step(1.0), rounds=12, steps=3, clock=jittery.clock)
    assert result.ratio == pytest.approx(1 / K, rel=0.02) and not result.noisy
    assert "too noisy" not in result.describe("DIFF", "Transformer")

    stormy = SharedMachine(lambda: rng.choice([1.0, 4.0]))  # neighbours come and go within each window
    result = paired_throughput(stormy.step(K), stormy.step(1.0), rounds=12, steps=3, clock=stormy.clock)
    assert result.noisy and result.spread > 0.05
    assert "too noisy to tell" in result.describe("DIFF", "Transformer")

    few = paired_throughput(jittery.step(K), jittery.step(1.0), rounds=4, steps=1, clock=jittery.clock)
    assert few.interval is None and few.noisy  # too few rounds for an interval: not a measurement to trust
