"""The length model behind the taper: E[L | L > g] from completed and still-running requests."""

import math
import random

from budgetq.worker.estimator import BINS, LengthModel, kaplan_meier_tail

MAX = 8192
WIDTH = MAX // BINS


def _lognormal(n: int, mean: float = 3793, sigma: float = 1.0, seed: int = 1) -> list[int]:
    r = random.Random(seed)
    mu = math.log(mean) - sigma**2 / 2
    return [min(MAX, int(r.lognormvariate(mu, sigma))) for _ in range(n)]


def _hist(lengths: list[int]) -> dict[str, int]:
    out: dict[str, int] = {}
    for x in lengths:
        out[str(x // WIDTH)] = out.get(str(x // WIDTH), 0) + 1
    return out


def test_conditional_means_match_the_sample_within_a_bin_width():
    lengths = _lognormal(50_000)
    m = LengthModel()
    m.set_histogram("D", MAX, _hist(lengths))
    for g in (0, 1000, 3000, 6000, 8000):
        tail = [x for x in lengths if x > g]
        assert abs(m.expected_length("D", g, MAX) - sum(tail) / len(tail)) < WIDTH, g


def test_running_requests_lift_an_estimate_biased_by_the_short_answers_that_finished_first():
    lengths = _lognormal(2000)
    finished_early = [x for x in lengths if x < 1500]  # what the histogram holds early in a run
    m = LengthModel()
    m.set_histogram("D", MAX, _hist(finished_early))
    biased = m.expected_length("D", 1000, MAX)
    assert biased < 1500  # says "short", although the true E[L | L > 1000] is ~3,800
    m.set_running("D", MAX, [1500.0] * 100, weight=2.0)
    assert m.expected_length("D", 1000, MAX) > 3000
    # with nothing running again the histogram alone decides
    m.set_histogram("D", MAX, _hist(finished_early))
    assert m.expected_length("D", 1000, MAX) == biased


def test_few_samples_beyond_g_fall_back_to_between_g_and_the_cap():
    m = LengthModel()
    m.set_histogram("D", MAX, _hist([100] * 50 + [5000] * 2))
    assert m.expected_length("D", 4000, MAX) == (4000 + MAX) // 2
    assert m.expected_length("D", 9000, MAX) == MAX  # never above the cap
    assert LengthModel().expected_length("unknown", 0, MAX) == MAX // 2


def test_the_caps_point_mass_counts_at_max_tokens():
    # half the answers cut at max_tokens (bin 64): E[L | L > 7000] is the cap itself
    t = kaplan_meier_tail(WIDTH, MAX, {64: 50, 10: 50}, {})
    assert t.cond[60] == MAX and t.cond[0] is not None and abs(t.cond[0] - (MAX + 10.5 * WIDTH) / 2) < 1


def test_decode_rate_is_learnt_from_finished_requests():
    m = LengthModel()
    assert m.generated_so_far(10) == 0.0
    m.observe(1000, 2.0)
    m.observe(8, 1.0)  # too short to say anything: ignored
    assert m.generated_so_far(1.0) == 500.0
    m.observe(2000, 2.0)
    assert abs(m.rate_tok_s - (0.9 * 500 + 0.1 * 1000)) < 1e-9


def test_the_expectation_lies_between_what_was_generated_and_the_requests_cap():
    m = LengthModel()
    m.set_histogram("D", MAX, _hist(_lognormal(5000)))
    m.set_running("D", MAX, [2000.0] * 10)
    prev = 0
    for g in range(0, MAX + 1, 97):
        e = m.expected_length("D", g, MAX)
        assert g <= e <= MAX and e >= prev, (g, e)  # an older request is never expected shorter
        prev = e
    for cap in (50, 1000):  # a request's own max_tokens, below the dataset's
        assert all(min(g, cap) <= m.expected_length("D", g, cap) <= cap for g in range(0, 1200, 37))
