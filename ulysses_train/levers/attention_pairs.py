"""Query-key pairs an attention kernel computes for one document: the count the time model (time_model.py) turns
into FLOPs. Exact for full causal attention and for a sliding window (the sum of min(t + 1, w) over positions), and
at the granularity of a tiled kernel's whole tiles for FlashAttention-4's windows, whose ragged ends cost whole
tiles (`kernel_window_pairs`, from FA4's SM90 tile table). Chunked attention is causal attention within each chunk
(`chunk_pieces`). Pure arithmetic on lengths and tile sizes: no model, no machine (a `span` is a layer's Span,
model/geometry.py: its window and chunk read).
"""

from __future__ import annotations


def chunk_pieces(lengths, chunk: int) -> list[int]:
    """One sequence's documents cut at every multiple of `chunk` positions of the row: chunked attention is causal
    attention within each piece (the kernels get the pieces as documents)."""
    pieces, start = [], 0
    for n in lengths:
        end = start + n
        while start < end:
            cut = min(end, (start // chunk + 1) * chunk)
            pieces.append(cut - start)
            start = cut
    return pieces


def causal_pairs(n: int, span) -> float:
    """Query-key pairs a causal kernel computes for one document of `n` tokens: n^2 / 2 for full attention (the
    half of the square the rates are counted on); under a window of w keys the query at position t sees
    min(t + 1, w), summed exactly: w (w + 1) / 2 + (n - w) w. A window at least as long as the document is full
    attention."""
    w = span.size
    if span.kind == "window" and w < n:
        return w * (w + 1) / 2 + (n - w) * w
    return n * n / 2


# FlashAttention-4's tiles on SM90 for a local (sliding-window) mask, from flash_attn.cute 4.0.0b36's
# `_tile_size_fwd_sm90` and `_tile_size_bwd_sm90` (interface.py): the largest head_dim of each class ->
# ((forward query rows, key columns), (backward query rows, key columns)). The forward packs the query heads that
# share a KV head into its query rows (pack_gqa, on for GQA), so a forward tile spans rows / (heads / KV heads)
# positions. Not fitted: read off the kernel.
FA4_SM90_TILES = {64: ((192, 128), (128, 128)), 96: ((192, 128), (64, 128)), 128: ((128, 128), (64, 128)),
                  192: ((128, 96), (64, 96)), 256: ((128, 64), (64, 48))}


def fa4_tiles(head_dim: int) -> tuple:
    """FA4's ((forward rows, columns), (backward rows, columns)) on SM90 at `head_dim` (the widest class past 256)."""
    for bound in sorted(FA4_SM90_TILES):
        if head_dim <= bound:
            return FA4_SM90_TILES[bound]
    return FA4_SM90_TILES[max(FA4_SM90_TILES)]


def _floor_sum(n: int, m: int, a: int, b: int) -> int:
    """sum of floor((a i + b) / m) for i in 0..n-1 (a, b >= 0, m > 0), by the Euclid-like recursion."""
    total = 0
    while n > 0:
        if a >= m:
            total += (n - 1) * n // 2 * (a // m)
            a %= m
        if b >= m:
            total += n * (b // m)
            b %= m
        y_max = a * n + b
        if y_max < m:
            break
        n, b, m, a = y_max // m, y_max % m, a, m
    return total


def kernel_window_pairs(n: int, w: int, rows: int, cols: int) -> float:
    """Query-key pairs a tiled kernel computes for one document of `n` tokens under a causal window of `w` keys
    (positions t - w + 1 .. t), with tiles of `rows` query positions and `cols` keys: each query tile runs, for
    every one of its rows, every key tile its rows' windows touch, from the tile holding its first row's first key
    to the one holding its last row (cut at the document's end). Against the exact w (w + 1) / 2 + (n - w) w this
    counts the window's ragged ends to whole tiles: about (w + rows + cols) / w of it for a long document. A window
    at least as long as the document is full attention: n^2 / 2, as `causal_pairs`."""
    if w >= n:
        return n * n / 2
    full = n // rows  # query tiles of `rows` rows: tile i ends at row (i + 1) rows - 1
    # keys up to the end of each tile's last key tile: cols x (floor(last row / cols) + 1)
    last = cols * (_floor_sum(full, cols, rows, rows - 1) + full)
    # less the keys before each tile's first key tile, once its first row's window starts past key 0
    starts = (w - 1) // rows + 1
    if full > starts:
        last -= cols * _floor_sum(full - starts, cols, rows, starts * rows - w + 1)
    # the last key tile is cut at the document's end
    end_tile = (n - 1) // cols * cols
    touching = full - max(0, -(-(end_tile - rows + 1) // rows))
    last -= (end_tile + cols - n) * max(0, touching)
    pairs = last * rows
    if n > full * rows:  # a last, partial query tile
        first = max(0, full * rows - w + 1) // cols * cols
        pairs += (n - full * rows) * (n - first)
    return float(pairs)
