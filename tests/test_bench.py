"""The bench's own measuring tools (the bench itself runs the real model: `slimroute bench --quick`)."""

import numpy as np

from slimroute.bench import PeakRSS, classify_process_rss


def test_peak_rss_is_the_blocks_own_peak():
    big = np.ones(64 * 2**20 // 8)  # an earlier 64 MiB peak, freed before the block
    del big
    with PeakRSS() as before:
        pass
    with PeakRSS() as during:
        block = np.ones(256 * 2**20 // 8)  # 256 MiB touched inside the block
        del block
    assert during.peak - before.peak > 200 * 2**20


def test_fresh_classify_process_reports_its_peak_rss(model_dir):
    record = classify_process_rss(model_dir, ["refund my card", "app crash", "reset password"], 1, 32, None)
    assert record["items"] == 3
    assert 0.1 < record["peak_rss_gb"] < 8
