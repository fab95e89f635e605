"""The per-position tool on a task that needs long-range context (ulysses_train/long_range_demo.py): trained at 64
tokens and read at 256, the loss rises right after the trained length without YaRN, much less with YaRN, and not
at all after a few YaRN steps at 256. CPU, seconds."""

import math

import pytest
import torch

from ulysses_train.tools.long_range_demo import VALUES, keyed_sum_batch, run


def test_task_needs_the_key():
    ids = keyed_sum_batch(3, 12, torch.Generator().manual_seed(0))
    key = ids[:, 1:2]
    assert (ids[:, 0] == 0).all() and ((key >= 1) & (key <= 8)).all()
    x, y = ids[:, 2::2] - 16, ids[:, 3::2] - 16
    assert torch.equal(y, (x + key) % VALUES)


@pytest.mark.slow
def test_positions_beyond_the_trained_length_with_and_without_yarn():
    result = run(short=64, long=256)
    plain, yarn, tuned = result["curves"].values()
    reading_the_key = math.log(VALUES) / 2  # random x, free y
    for curve in result["curves"].values():  # within the trained length every variant reads the key
        assert curve["means"][1] < reading_the_key + 0.3
    # without YaRN the loss rises within a trained length after the trained length, and stays up
    assert plain["first_rise_position"] is not None and 64 <= plain["first_rise_position"] <= 128
    assert plain["tail_mean"] > plain["early_mean"] + 3
    # YaRN alone removes most of the rise; a few steps at the long length remove all of it
    assert yarn["tail_mean"] < plain["tail_mean"] - 2
    assert tuned["first_rise_position"] is None
    assert abs(tuned["tail_mean"] - reading_the_key) < 0.3
