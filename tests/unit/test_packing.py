"""Conversations into samples: first-fit-decreasing packing (contents, document lengths, labels at the boundaries),
one conversation per sample with padding, truncation left/right/error, and the counts the metrics report."""

import numpy as np
import pytest
import torch

from ulysses_train.data.packing import ConversationSamples, first_fit_decreasing
from ulysses_train.data.sources import ChatSource, build_batch, trainable_tokens
from ulysses_train.data.token_store import build_token_store
from ulysses_train.errors import ConfigError
from ulysses_train.sp.sharding import IGNORE_INDEX, shift_labels

PAD = 0


def _store(tmp_path, conversations):
    """conversations: (ids, trained) pairs; ids are distinct per conversation so samples show where each went."""
    rows = [{"input_ids": np.asarray(ids), "trained": np.asarray(mask)} for ids, mask in conversations]
    return build_token_store(rows, None, str(tmp_path / "cache"), "k", trained=True)


def _conversation(c, n, trained_from):
    """Conversation c of n tokens (ids 100c + position), trained from position `trained_from` on."""
    return [100 * c + i for i in range(n)], [int(i >= trained_from) for i in range(n)]


def _naive_ffd(lengths, capacity):
    bins = []
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        for b in bins:
            if sum(lengths[j] for j in b) + lengths[i] <= capacity:
                b.append(i)
                break
        else:
            bins.append([i])
    return [sorted(b) for b in bins]


def test_first_fit_decreasing_by_hand_and_against_a_plain_implementation():
    order, starts = first_fit_decreasing(np.array([5, 3, 7, 2, 4, 1]), 8)
    assert [order[a:b].tolist() for a, b in zip(starts, starts[1:])] == [[2, 5], [0, 1], [3, 4]]
    rng = np.random.default_rng(0)
    for n in (1, 2, 7, 100, 333):
        lengths = rng.integers(1, 65, n)
        order, starts = first_fit_decreasing(lengths, 64)
        bins = [order[a:b].tolist() for a, b in zip(starts, starts[1:])]
        assert bins == _naive_ffd(lengths.tolist(), 64)
        assert sorted(order.tolist()) == list(range(n)) and all(lengths[b].sum() <= 64 for b in bins)
        assert len(bins) <= 11 / 9 * -(-lengths.sum() // 64) + 1


def test_packed_samples_boundaries_and_labels(tmp_path):
    convs = [_conversation(0, 5, 2), _conversation(1, 9, 4), _conversation(2, 3, 1), _conversation(3, 6, 0)]
    samples = ConversationSamples(_store(tmp_path, convs), 12, "error", True, PAD)
    # lengths 5, 9, 3, 6 into 12: 9 -> s0, 6 -> s1, 5 -> s1, 3 -> s0; dataset order inside a sample
    assert [samples.conversations(i) for i in range(len(samples))] == [[1, 2], [0, 3]]
    ids, labels, valid, docs = samples.sample(1)
    assert valid == 11 and docs == [5, 6, 1]
    assert ids.tolist() == [0, 1, 2, 3, 4, 300, 301, 302, 303, 304, 305, PAD]
    assert labels.tolist() == [-100, -100, 2, 3, 4, 300, 301, 302, 303, 304, 305, -100]
    batch = build_batch([ChatSource(samples).get(1)], packing=True)
    assert batch["docs"] == [[5, 6, 1]] and batch["conversations"] == 2
    assert batch["position_ids"].tolist() == [[0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 5, 0]]
    # conversation 3 is trained from its first token on, but its first token is no target: its context would be
    # conversation 0; the padding is never a target
    assert batch["labels"][0, 5] == IGNORE_INDEX and batch["labels"][0, 6] == 301 and batch["labels"][0, 11] == -100
    shifted = shift_labels(batch["input_ids"], batch["labels"])[0]
    assert shifted.tolist() == [-100, 2, 3, 4, -100, 301, 302, 303, 304, 305, -100, -100]
    assert trainable_tokens(batch) == 8


def test_one_conversation_per_sample_is_padded_never_trained(tmp_path):
    convs = [_conversation(0, 5, 2), _conversation(1, 9, 4)]
    samples = ConversationSamples(_store(tmp_path, convs), 12, "error", False, PAD)
    assert len(samples) == 2
    ids, labels, valid, docs = samples.sample(0)
    assert valid == 5 and docs == [5, 7] and ids[5:].tolist() == [PAD] * 7 and (labels[5:] == -100).all()
    batch = build_batch([ChatSource(samples).get(i) for i in range(2)], packing=False)
    assert batch["docs"] is None and batch["conversations"] == 2
    assert batch["position_ids"][1].tolist() == list(range(12))
    assert trainable_tokens(batch) == 3 + 5


@pytest.mark.parametrize("truncation", ["left", "right"])
def test_truncation_keeps_the_end_or_the_start(tmp_path, truncation):
    convs = [_conversation(0, 14, 10), _conversation(1, 4, 2), _conversation(2, 20, 0)]
    samples = ConversationSamples(_store(tmp_path, convs), 8, truncation, True, PAD)
    assert samples.truncated == 2 and samples.kept.tolist() == [8, 4, 8]
    ids, labels, valid, docs = samples.sample(samples.order.tolist().index(0))  # conversation 0 alone
    assert valid == 8 and docs == [8]
    if truncation == "left":
        assert ids.tolist() == list(range(6, 14)) and labels.tolist() == [-100] * 4 + [10, 11, 12, 13]
    else:
        assert ids.tolist() == list(range(8)) and (labels == -100).all()
    describe = samples.describe()
    assert f"2 cut to 8 (--truncation {truncation})" in describe
    assert ("1 with no trained token" in describe) == (truncation == "right")
    assert samples.trained_counts().tolist() == ([4, 2, 8] if truncation == "left" else [0, 2, 8])


def test_truncation_error_gives_the_count_the_longest_and_the_flag(tmp_path):
    store = _store(tmp_path, [_conversation(0, 14, 0), _conversation(1, 4, 0), _conversation(2, 20, 0)])
    with pytest.raises(ConfigError, match=r"^2 conversation\(s\) are longer than --seq_len 8 \(the longest has 20 "
                                          r"tokens\): raise --seq_len, or cut them with --truncation left .* or "
                                          r"--truncation right"):
        ConversationSamples(store, 8, "error", True, PAD)
    with pytest.raises(ConfigError, match="longer than --verify_seq_len 8"):
        ConversationSamples(store, 8, "error", False, PAD, "--verify_seq_len")
    assert len(ConversationSamples(store, 20, "error", False, PAD)) == 3


def test_packing_is_deterministic_and_loses_nothing(tmp_path):
    rng = np.random.default_rng(1)
    convs = [_conversation(c, int(n), int(n) // 2) for c, n in enumerate(rng.integers(1, 40, 50))]
    store = _store(tmp_path, convs)
    a, b = (ConversationSamples(store, 64, "error", True, PAD) for _ in range(2))
    assert np.array_equal(a.order, b.order) and np.array_equal(a.starts, b.starts)
    seen = torch.cat([a.sample(i)[0][:a.sample(i)[2]] for i in range(len(a))])
    assert sorted(seen.tolist()) == sorted(t for ids, _ in convs for t in ids)
    assert int(sum((a.sample(i)[1] != -100).sum() for i in range(len(a)))) == sum(sum(m) for _, m in convs)


def test_text_and_generated_sources_count_documents():
    ids = torch.arange(3, 19)
    assert build_batch([(ids, 16, None)], packing=False)["conversations"] == 1
    assert build_batch([(ids, 12, [5, 7, 4])], packing=True)["conversations"] == 2  # the padding is no document
    assert build_batch([(ids, 16, [5, 11])], packing=False)["docs"] is None  # without packing: counted only
