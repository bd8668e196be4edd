"""bench_stream.py --sections loader and checkpoint: what the sub-streams' state costs, a step and at a checkpoint.

The loader's state a step (training/stream/loader.py), for each --seq-len: one sub-stream's
state with --pack once 1,500 rows are made (its packer's 128 rows open by then), which a
worker sends with every step's rows of the sub-stream:
  size          the packer's open rows' tokens, int32 (the cursor is a few ints)
  make          SubStreamRows.state_dict() (the median of 50)
  receive       the main process's wait for a worker's item that holds it, the worker always
                ahead (the median of 200), and for one that holds its cursor alone

The states a checkpoint holds (training/stream/run.py), for each --seq-len: 8 packed sub-streams
(the default --sub-streams) of the corpus rewritten in 32 row groups (its own are 10,000 rows
each: 4 pieces, too few to deal to 8), read by 2 ranks (StreamFeed, 4 sub-streams each) for
--steps steps of one row from each:
  open rows     the packers' open rows, the mean of the 8 (128 at most)
  tokens        their tokens, int32, the 8 together
  sent          what each rank's gather_object sends: its 4 states pickled
  saved         the 8 states as torch.save writes them into the checkpoint
  gather        run.gather_states, 2 gloo ranks as threads of this process (the median of 20)

one_sub_stream serves bench_stream.py's rows a second too.
"""

import statistics
import time
from pathlib import Path


def add_arguments(p):
    """--sections checkpoint's flag, in bench_stream.py's parser."""
    from training.errors import at_least
    p.add_argument("--steps", type=at_least(1), default=400, help="--sections checkpoint: the steps read first")


def one_sub_stream(path: Path, tokenizer, seq_len: int, pack: bool):
    """The corpus as one sub-stream (its documents in a shuffle of its row groups) read for one epoch."""
    from training.stream import shards
    from training.stream.order import SubStreams
    from training.stream.rows import SubStreamRows
    [shard] = shards.find_shards(str(path), "text")
    return SubStreamRows(SubStreams(list(shard.pieces), 1, seed=0), 0,
                         lambda piece, row: shards.read_documents(str(path), shard, piece, row, "text"),
                         tokenizer, seq_len, pack, epochs=1)


def state_cost(path: Path, tokenizer, seq_len: int, rows: int = 1500) -> dict:
    """A packed sub-stream's state after `rows` rows (or all it has): its size, the time to make
    it, and the main process's wait for a worker's item that holds it, or its cursor alone."""
    import copy
    import itertools
    import torch
    from torch.utils.data import DataLoader, IterableDataset

    class Again(IterableDataset):  # an item again and again, a fresh copy each time, as a worker makes them
        def __init__(self, item):
            self.item = item

        def __iter__(self):
            while True:
                yield copy.deepcopy(self.item)

    sub_stream = one_sub_stream(path, tokenizer, seq_len, pack=True)
    for _ in itertools.islice(sub_stream, rows):
        pass
    made = []
    for _ in range(50):
        start = time.perf_counter()
        state = sub_stream.state_dict()
        made.append(time.perf_counter() - start)
    received = {}
    for name, item in (("state", state), ("cursor", state["cursor"])):
        items = iter(DataLoader(Again(item), batch_size=None, num_workers=1, collate_fn=lambda item: item,
                                multiprocessing_context="fork", generator=torch.Generator()))
        next(items)  # the worker started
        waits = []
        for _ in range(200):
            time.sleep(0.005)  # the worker makes its next item meanwhile
            start = time.perf_counter()
            got = next(items)
            waits.append(time.perf_counter() - start)
        received[name] = statistics.median(waits)
        if name == "state":  # what came is the state, its tokens whole
            received["mb"] = got["packer"]["tokens"].nbytes / 1e6 if got.get("packer") else 0
    return {"open_rows": len(state["packer"]["windows"]), "mb": state["packer"]["tokens"].nbytes / 1e6,
            "make_ms": statistics.median(made) * 1e3, "receive_ms": received["state"] * 1e3,
            "cursor_ms": received["cursor"] * 1e3, "received_mb": received["mb"]}


def checkpoint_cost(path: Path, tokenizer, seq_len: int, steps: int, streams: int = 8, world_size: int = 2) -> dict:
    """`streams` packed sub-streams read by `world_size` ranks for `steps` steps of a row from
    each: their states' size as gather_states sends them and as a checkpoint holds them, and
    the time to gather them (gloo ranks as threads)."""
    import io
    import itertools
    import pickle
    import torch
    from training.stream import run, shards
    from training.stream.loader import StreamFeed
    from training.stream.order import SubStreams
    pieces = in_row_groups(path, 32)
    [shard] = shards.find_shards(str(pieces), "text")
    sub_streams = SubStreams(list(shard.pieces), streams, seed=0)
    feeds = [StreamFeed(sub_streams, lambda piece, row: shards.read_documents(str(pieces), shard, piece, row, "text"),
                        tokenizer, seq_len, True, epochs=1, batch_size=streams, world_size=world_size, rank=rank)
             for rank in range(world_size)]
    for feed in feeds:
        for _ in itertools.islice(feed, steps):
            pass
    states = {s: state for feed in feeds for s, state in feed.state_dict().items()}
    saved = io.BytesIO()
    torch.save(states, saved)

    def gather(rank, group) -> list[float]:
        waits = []
        for _ in range(20):
            start = time.perf_counter()
            run.gather_states(feeds[rank], group)
            waits.append(time.perf_counter() - start)
        return waits
    waits = on_gloo_ranks(world_size, gather)[0]
    return {"open_rows": statistics.mean(len(state["packer"]["windows"]) for state in states.values()),
            "tokens_mb": sum(state["packer"]["tokens"].nbytes for state in states.values()) / 1e6,
            "sent_mb": max(len(pickle.dumps(feed.state_dict())) for feed in feeds) / 1e6,
            "saved_mb": saved.tell() / 1e6, "gather_ms": statistics.median(waits) * 1e3}


def in_row_groups(path: Path, groups: int) -> Path:
    """The corpus rewritten beside it in `groups` row groups (its own are 10,000 rows each), once."""
    import pyarrow.parquet as pq
    pieces = path.with_name(f"{path.stem}.{groups}_row_groups.parquet")
    if not pieces.exists():  # written whole, then named: an interrupted write leaves no half a corpus
        table = pq.read_table(path)
        pq.write_table(table, pieces.with_suffix(".tmp"), row_group_size=-(-len(table) // groups))
        pieces.with_suffix(".tmp").rename(pieces)
    return pieces


def on_gloo_ranks(world_size: int, work) -> list:
    """work(rank, group) on `world_size` ranks, each a thread of this process with a gloo group of
    its own (no process group to set up, as torchrun would): their results, or the first error."""
    import datetime
    import threading
    import warnings
    import torch.distributed as dist
    store, results, errors = dist.HashStore(), [None] * world_size, []

    def rank_loop(rank):
        try:
            group = dist.ProcessGroupGloo(dist.PrefixStore("ranks", store), rank, world_size,
                                          datetime.timedelta(seconds=60))
            results[rank] = work(rank, group)
        except BaseException as e:
            errors.append(e)
    threads = [threading.Thread(target=rank_loop, args=(rank,)) for rank in range(world_size)]
    with warnings.catch_warnings():  # torch's, of an object collective on a group made by hand, as here
        warnings.filterwarnings("ignore", "You are using a Backend")
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    if errors:
        raise errors[0]
    return results


def loader_table(path: Path, tokenizer, seq_lens: list[int]) -> dict:
    print("\nthe loader's state a step: one packed sub-stream's, as its worker sends it")
    print(f"  {'--seq-len':<12}{'open rows':>10}{'size':>10}{'make':>10}{'receive':>10}{'cursor alone':>14}")
    results = {}
    for seq_len in seq_lens:
        row = results[seq_len] = state_cost(path, tokenizer, seq_len)
        print(f"  {seq_len:<12}{row['open_rows']:10,}{row['mb']:7.2f} MB{row['make_ms']:7.2f} ms"
              f"{row['receive_ms']:7.2f} ms{row['cursor_ms']:11.2f} ms", flush=True)
    return results


def checkpoint_table(path: Path, tokenizer, seq_lens: list[int], steps: int) -> dict:
    print(f"\nthe states a checkpoint holds: 8 packed sub-streams after {steps} steps, gathered from 2 ranks")
    print(f"  {'--seq-len':<12}{'open rows':>10}{'tokens':>11}{'sent':>11}{'saved':>11}{'gather':>10}")
    results = {}
    for seq_len in seq_lens:
        row = results[seq_len] = checkpoint_cost(path, tokenizer, seq_len, steps)
        print(f"  {seq_len:<12}{row['open_rows']:10.0f}{row['tokens_mb']:8.2f} MB{row['sent_mb']:8.2f} MB"
              f"{row['saved_mb']:8.2f} MB{row['gather_ms']:7.1f} ms", flush=True)
    return results
