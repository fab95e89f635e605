"""The records of a wandb run file (`run-<id>.wandb`, what an offline run writes and `wandb sync` uploads), read the
way wandb writes them: a 7-byte header (`:W&B`, a magic number, a version), then LevelDB's log format, 32 KiB blocks
of chunks (a 7-byte chunk header: checksum, length, type), each record a protobuf `Record`. wandb no longer ships a
reader in Python (its Go core writes these files)."""

import struct

HEADER = 7
BLOCK = 32768
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def wandb_records(path: str) -> list:
    from wandb.proto import wandb_internal_pb2

    data = open(path, "rb").read()
    assert data[:4] == b":W&B", f"{path} is not a wandb run file"
    records, pending, offset = [], b"", HEADER
    while offset + HEADER <= len(data):
        if BLOCK - offset % BLOCK < HEADER:  # no room for a chunk header: the block's tail is padding
            offset += BLOCK - offset % BLOCK
            continue
        _, length, kind = struct.unpack("<IHB", data[offset:offset + HEADER])
        chunk = data[offset + HEADER:offset + HEADER + length]
        offset += HEADER + length
        if kind == 0 and length == 0:  # zeroes: preallocated, never written
            break
        pending = chunk if kind in (FULL, FIRST) else pending + chunk
        if kind in (FULL, LAST):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            records.append(record)
    return records
