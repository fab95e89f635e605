import torch

from ulysses_train.sp.sharding import IGNORE_INDEX, shard_sequence, shift_labels


def test_labels_shift_across_shard_boundaries():
    ids = torch.arange(10, 18)[None]  # (1, 8)
    shards = [shard_sequence(ids, 4, r) for r in range(4)]
    labels = torch.cat([s["labels"] for s in shards], dim=1)
    assert labels.tolist() == [[11, 12, 13, 14, 15, 16, 17, IGNORE_INDEX]]
    # the last label of shard 0 is the first token of shard 1
    assert shards[0]["labels"][0, -1].item() == shards[1]["input_ids"][0, 0].item()
    positions = torch.cat([s["position_ids"] for s in shards], dim=1)
    assert positions.tolist() == [list(range(8))]


def test_padding_to_multiple_of_sp_is_ignored():
    ids = torch.arange(1, 8)[None]  # 7 tokens, sp 4 -> padded to 8
    shards = [shard_sequence(ids, 4, r, pad_token_id=0) for r in range(4)]
    assert all(s["input_ids"].shape == (1, 2) for s in shards)
    labels = torch.cat([s["labels"] for s in shards], dim=1)[0].tolist()
    assert labels == [2, 3, 4, 5, 6, 7, IGNORE_INDEX, IGNORE_INDEX]
    assert torch.cat([s["position_ids"] for s in shards], dim=1)[0].tolist() == list(range(8))


def test_explicit_labels_are_shifted_and_keep_ignores():
    ids = torch.tensor([[5, 6, 7, 8]])
    labels = torch.tensor([[IGNORE_INDEX, IGNORE_INDEX, 7, 8]])
    assert shift_labels(ids, labels).tolist() == [[IGNORE_INDEX, 7, 8, IGNORE_INDEX]]
