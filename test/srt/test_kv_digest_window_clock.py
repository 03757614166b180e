"""What a prefill rank learns of its link and its window steps decides which steps run inside a
transfer (``kv_digest_window_clock``): nothing known, everything fits; a transfer the worker
waited for gives the link's rate, one its steps outlasted only a lower bound; a step fits
where its own moving average ends before the expected landing."""

from __future__ import annotations

import time

import pytest

from sglang_dflash_pp.srt.disaggregation.kv_digest_window_clock import SMOOTHING, WindowClock


def test_nothing_known_every_step_fits():
    clock = WindowClock()
    assert clock.deadline(10.0, 1 << 20) is None
    assert clock.fits("engine", None)
    clock.link_bps = 1e9
    assert clock.fits("engine", clock.deadline(time.perf_counter(), 1))  # no engine time seen


def test_a_waited_transfer_gives_the_rate_and_one_outlasted_only_raises_it():
    clock = WindowClock()
    # 50 MB, submitted at 0, steps done at 0.2 ms, landed (status returned) at 1 ms: 50 GB/s
    clock.landed(50_000_000, 0.0, 0.0002, 0.001)
    assert clock.link_bps == pytest.approx(5e10)
    assert clock.deadline(2.0, 25_000_000) == pytest.approx(2.0005)
    # the next one waited too, at 25 GB/s: the estimate moves by SMOOTHING of the difference
    clock.landed(25_000_000, 0.0, 0.0002, 0.001)
    assert clock.link_bps == pytest.approx(5e10 + SMOOTHING * (2.5e10 - 5e10))
    rate = clock.link_bps
    # steps outlasting a transfer: the bytes landed before 2 ms, so at least 20 GB/s: no news
    clock.landed(40_000_000, 0.0, 0.002, 0.002)
    assert clock.link_bps == rate
    # ... but at least 100 GB/s is: the estimate rises toward it
    clock.landed(100_000_000, 0.0, 0.001, 0.001)
    assert clock.link_bps == pytest.approx(rate + SMOOTHING * (1e11 - rate))


def test_a_step_fits_where_its_moving_average_ends_before_the_landing():
    clock = WindowClock()
    clock.took("engine", 0.004)
    clock.took("engine", 0.008)
    assert clock.step_s["engine"] == pytest.approx(0.004 + SMOOTHING * 0.004)
    now = time.perf_counter()
    assert clock.fits("engine", now + 1.0)
    assert not clock.fits("engine", now + 0.001)
    assert clock.fits("resolve", now + 0.001)  # its own time is not known yet
