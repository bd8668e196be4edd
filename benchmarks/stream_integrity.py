"""bench_stream.py --sections integrity: what checking the pieces read again costs (training/stream/integrity.py).

Each figure with the check and without it (integrity.chained made a no-op, or the check's
reading left out), on the corpus rewritten in 32 row groups (stream_state.in_row_groups), one
sub-stream reading them all, on one core:
  documents/s   order.documents alone (read, decoded, each document's row and text chained)
  rows/s        SubStreamRows' padded rows at the first --seq-len (tokenized and cut too), for
                at most 10 s each
  later epoch   a piece read whole before is read once whole and checked before its rows are
                made: the time of that reading, against the time its rows take, for one row group
  resume        the piece in progress at a resume, its cursor at its last row: read up to it
                with its documents decoded and chained (order.check_read), against only counted
                (read(piece, row), before)
  state         the pieces-read table a sub-stream's state carries, 12,500 pieces (a 100 GB
                corpus in row groups of 1,000 rows, over 8 sub-streams): its bytes, and the main
                process's wait for a worker's item that holds it with a cursor, against the
                cursor alone (the median of 200). A worker sends it in the step it changed only
                (a piece's end: loader._Shares._unsent); every other step costs the cursor's
"""

import statistics
import time
from pathlib import Path

TABLE_PIECES = 12_500


def _one_core(fn):
    import torch
    from training import tokenized
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with tokenized.tokenizer_threads(1):
            return fn()
    finally:
        torch.set_num_threads(threads)


def _without_chain():
    """integrity.chained as a no-op, for the figures without the check."""
    import contextlib
    from training.stream import integrity
    real = integrity.chained

    @contextlib.contextmanager
    def patched():
        integrity.chained = lambda digest, row, text: digest
        try:
            yield
        finally:
            integrity.chained = real
    return patched()


def _sub_stream(pieces: Path):
    from training.stream import shards
    from training.stream.order import SubStreams
    [shard] = shards.find_shards(str(pieces), "text")
    sub_streams = SubStreams(list(shard.pieces), 1, seed=0, describe=shards.describe(str(pieces), [shard]))
    return shard, sub_streams, shards.reader(str(pieces), [shard], "text")


def documents_per_s(pieces: Path) -> float:
    from training.stream.order import Cursor, documents
    _, sub_streams, read = _sub_stream(pieces)
    start, n = time.perf_counter(), 0
    for n, _ in enumerate(documents(Cursor(sub_streams, 0), read, epochs=1), start=1):
        pass
    return n / (time.perf_counter() - start)


def rows_per_s(pieces: Path, tokenizer, seq_len: int, seconds: float = 10.0) -> float:
    from training.stream.rows import SubStreamRows
    _, sub_streams, read = _sub_stream(pieces)
    rows = SubStreamRows(sub_streams, 0, read, tokenizer, seq_len, False, epochs=1)
    start, made = time.perf_counter(), 0
    for made, _ in enumerate(rows, start=1):
        if time.perf_counter() - start > seconds:
            break
    return made / (time.perf_counter() - start)


def later_epoch(pieces: Path, tokenizer, seq_len: int) -> dict:
    """Row group 0 read whole and checked, against its rows made."""
    from training.stream import integrity
    from training.stream.rows import SubStreamRows
    from training.stream.order import SubStreams
    shard, _, read = _sub_stream(pieces)
    start = time.perf_counter()
    integrity.piece_digest(read(0, 0))
    check_s = time.perf_counter() - start
    one = SubStreams([shard.pieces[0]], 1, seed=0)
    rows = SubStreamRows(one, 0, read, tokenizer, seq_len, False, epochs=1)
    start = time.perf_counter()
    for _ in rows:
        pass
    return {"check_s": check_s, "rows_s": time.perf_counter() - start}


def resume(pieces: Path) -> dict:
    """A cursor at the last row of row group 0: the prefix read and chained, or only counted."""
    from training.stream import integrity, order
    shard, sub_streams, read = _sub_stream(pieces)
    piece = sub_streams.pieces(0, 0).index(0)
    last = shard.pieces[0] - 1
    cursor = order.Cursor(sub_streams, 0)
    cursor.piece = piece
    for row, text in read(0, 0):  # the digest the run would have saved there
        if row < last:
            cursor.digest = integrity.chained(cursor.digest, row, text)
    cursor.row = last
    start = time.perf_counter()
    order.check_read(cursor, read)
    checked = time.perf_counter() - start
    start = time.perf_counter()
    for _ in read(0, last):
        break
    return {"checked_s": checked, "counted_s": time.perf_counter() - start}


def state_receive(pieces_read: int = TABLE_PIECES) -> dict:
    """The main process's wait for a worker's item: a cursor with the table, or the cursor alone."""
    import torch
    from torch.utils.data import DataLoader, IterableDataset
    cursor = {"stream": 0, "streams": 8, "epoch": 3, "piece": 17, "row": 512, "dealt": "0" * 16, "digest": "0" * 16}
    table = torch.arange(2 * pieces_read, dtype=torch.int64).reshape(-1, 2)

    class Again(IterableDataset):  # the table each step, as at a piece's end, and a fresh cursor
        def __init__(self, with_table: bool):
            self.with_table = with_table

        def __iter__(self):
            while True:
                yield {"cursor": dict(cursor), **({"read": table} if self.with_table else {})}
    waits = {}
    for name, with_table in (("table", True), ("cursor", False)):
        items = iter(DataLoader(Again(with_table), batch_size=None, num_workers=1, collate_fn=lambda item: item,
                                multiprocessing_context="fork", generator=torch.Generator()))
        next(items)
        times = []
        for _ in range(200):
            time.sleep(0.005)  # the worker makes its next item meanwhile
            start = time.perf_counter()
            next(items)
            times.append(time.perf_counter() - start)
        waits[name] = statistics.median(times)
    return {"mb": table.nbytes / 1e6, "table_ms": waits["table"] * 1e3, "cursor_ms": waits["cursor"] * 1e3}


def table(path: Path, tokenizer, seq_len: int) -> dict:
    from benchmarks.stream_state import in_row_groups
    pieces = in_row_groups(path, 32)
    print(f"\nchecking what is read again (training/stream/integrity.py), one sub-stream on one core, "
          f"--seq-len {seq_len} padded")
    runs = {"with": [], "without": []}
    for _ in range(3):  # alternated, the median of 3 each: a shared machine's load moves both alike
        for check in ("with", "without"):
            def measure():
                return {"documents_per_s": documents_per_s(pieces),
                        "rows_per_s": rows_per_s(pieces, tokenizer, seq_len)}
            if check == "with":
                runs[check].append(_one_core(measure))
            else:
                with _without_chain():
                    runs[check].append(_one_core(measure))
    results = {check: {key: statistics.median(run[key] for run in runs[check]) for key in runs[check][0]}
               for check in runs}
    print(f"  {'':<16}{'documents/s':>14}{'rows/s':>10}")
    for check in ("with", "without"):
        row = results[check]
        print(f"  {check + ' check':<16}{row['documents_per_s']:14,.0f}{row['rows_per_s']:10,.0f}")
    later = results["later_epoch"] = _one_core(lambda: later_epoch(pieces, tokenizer, seq_len))
    print(f"  a later epoch's row group: read and checked first in {later['check_s']:.2f} s, its rows made in "
          f"{later['rows_s']:.2f} s (+{later['check_s'] / later['rows_s']:.1%})")
    again = results["resume"] = _one_core(lambda: resume(pieces))
    print(f"  a resume at a row group's last row: read up to it and checked in {again['checked_s']:.2f} s, "
          f"counted only in {again['counted_s']:.2f} s")
    state = results["state"] = state_receive()
    print(f"  the state's table of {TABLE_PIECES:,} pieces read: {state['mb']:.2f} MB a sub-stream, received with "
          f"its cursor (at a piece's end) in {state['table_ms']:.2f} ms, the cursor alone in "
          f"{state['cursor_ms']:.2f} ms",
          flush=True)
    return results
