"""Measure --stream on a FineWeb-shaped corpus: the online packer, one sub-stream's rows, the BPE, and the launch.

    python bench_stream.py                                   # a generated 100 MB corpus, --seq-lens 512 1024 2048
    python bench_stream.py --open-rows 32 128 --mb 200
    python bench_stream.py --sections bpe                    # the BPE alone
    python bench_stream.py --sections loader                 # the cost of the loader's state a step
    python bench_stream.py --sections checkpoint             # the states a checkpoint gathers and holds
    python bench_stream.py --sections integrity              # checking the pieces read again, with and without
    python bench_stream.py --sections launch                 # the trainers' launch, --stream and map-style
                                                             # (not by default: minutes, and a 1 GB corpus)

The corpus is bench_data.py's (generated once, FineWeb's shape: log-normal document lengths,
median about 1,800 characters) with its 50,000-token BPE. Its documents, in the file's order,
are tokenized and cut into windows as data.py cuts them (training/tokenized.py); then, for each
--seq-len, the same windows are placed in rows of that many positions:
  offline       packing.best_fit_decreasing over every window's size at once: --pack today
  online N      training/stream/packer.py's OnlinePacker with N rows open (--open-rows), the
                windows one at a time in the corpus's order, as a stream brings them
  padding       the share of the rows' positions that hold no token: of the rows closed while
                the stream ran ("in stream"), and of all rows, those flushed at its end
                included ("with flush"). The flush is N rows at most, whatever the stream's
                length: on a long stream the padding tends to the first
  vs offline    in stream less offline, in points (the issue's goal: within 1)
  most windows  the most windows a row holds (the cu_seqlens bound: packer.window_bound)
  windows/s     OnlinePacker.add over every window, then its flush, in one process (the
                median of 3)

Then, for each --seq-len, one sub-stream's rows a second (training/stream/rows.py): the corpus
read as --stream reads it (each parquet row group a piece), every document tokenized and cut
into windows, padded, or packed with 128 rows open, each row made the tensors the trainers
take; on one core (one torch thread, tokenizers' parallelism off), for at most 10 s each.

The sub-streams' state, for each --seq-len (benchmarks/stream_state.py says what and how):
  loader        the loader's state a step: one packed sub-stream's, as its worker sends it
  checkpoint    the states a checkpoint holds: 8 packed sub-streams', gathered from 2 ranks
  integrity     what checking the pieces read again costs, with the check and without it, at
                the first --seq-len (benchmarks/stream_integrity.py)

The BPE of a run without --tokenizer (--vocab-size tokens, data.TOKENIZER_TRAIN_CHARS at most),
each way in a fresh process, from the corpus's file to the trained tokenizer:
  map-style     run_data.load_text (load_corpus on a fresh `datasets` cache, the seeded split)
                and run_data.get_tokenizer: what the scripts run today
  stream        find_shards, holdout.validation_documents (--val-docs' default) and
                holdout.train_stream_tokenizer: the training documents in shard order, read lazily
  peak RSS      the process's most resident memory (imports included)

The launch: train_dp.py's (and train_ddp.py's) from launch to first step, --stream and map-style,
on generated corpora of --launch-mbs MB (benchmarks/stream_launch.py says what and how).
"""

import argparse
import shutil
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root, from any folder


SECTIONS = ["packer", "bpe", "loader", "checkpoint", "integrity", "launch"]  # launch: minutes, and a 1 GB corpus: asked for


def parse_args(argv=None):
    from benchmarks import bench_data, stream_launch, stream_state
    from training.errors import ArgumentParser, at_least
    p = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seq-lens", type=at_least(1), nargs="+", default=[512, 1024, 2048])
    p.add_argument("--open-rows", type=at_least(1), nargs="+", default=[8, 32, 128, 512],
                   help="rows the online packer holds open, one table row each")
    p.add_argument("--sections", nargs="+", choices=SECTIONS, default=SECTIONS[:-1])
    stream_state.add_arguments(p)
    stream_launch.add_arguments(p)
    bench_data.add_corpus_arguments(p, megabytes=100)
    args = p.parse_args(argv)
    bench_data.check_data(args)
    return args


def stream_windows(texts: list[str], tokenizer, seq_len: int) -> list:
    """The documents' windows in their order, each an array of token ids, cut by tokenized.tokenize
    (on a `datasets` cache of its own, removed after)."""
    import datasets
    import numpy as np
    from benchmarks import bench_data
    from training import tokenized
    cache = bench_data.fresh_cache()
    try:
        windows = tokenized.tokenize(datasets.Dataset.from_dict({"text": texts}), tokenizer, seq_len)
        column = windows.with_format("arrow")[:]["input_ids"].combine_chunks()
        return np.split(column.flatten().to_numpy(), column.offsets.to_numpy()[1:-1])
    finally:
        shutil.rmtree(cache, ignore_errors=True)


def online(windows: list, seq_len: int, open_rows: int, repeats: int = 3) -> dict:
    """The windows through an OnlinePacker, one at a time: its rows' padding, in stream and with
    the flush, the most windows a row holds (and the most it may), and windows a second (the
    median of `repeats` packings: each makes the same rows)."""
    from training.stream.packer import OnlinePacker
    seconds = []
    for _ in range(repeats):
        packer, closed = OnlinePacker(seq_len, open_rows), []
        start = time.perf_counter()
        for window in windows:
            closed += packer.add(window)
        flushed = packer.flush()
        seconds.append(time.perf_counter() - start)
    return {"rows": len(closed) + len(flushed), "padding": padding(closed + flushed, seq_len),
            "in_stream": padding(closed, seq_len), "flushed": len(flushed),
            "most_windows": max(map(len, closed + flushed)), "bound": packer.max_windows - 1,
            "windows_per_s": len(windows) / statistics.median(seconds)}


def sub_stream_rows_per_s(path: Path, tokenizer, seq_len: int, pack: bool, seconds: float = 10.0) -> float:
    """Rows a second of one sub-stream of the corpus, on one core: as many as `seconds` allow,
    or all of them."""
    import torch
    from benchmarks.stream_state import one_sub_stream
    from training import tokenized
    rows = one_sub_stream(path, tokenizer, seq_len, pack)
    threads, made = torch.get_num_threads(), 0
    torch.set_num_threads(1)
    try:
        with tokenized.tokenizer_threads(1):
            start = time.perf_counter()
            for made, _ in enumerate(rows, start=1):
                if time.perf_counter() - start > seconds:
                    break
            return made / (time.perf_counter() - start)
    finally:
        torch.set_num_threads(threads)


def padding(rows: list, seq_len: int) -> float:
    """The share of the rows' positions that hold no token (a window of n tokens fills n - 1)."""
    filled = sum(len(window) - 1 for row in rows for window in row)
    return 1 - filled / (len(rows) * seq_len) if rows else 0.0


def offline(windows: list, seq_len: int) -> dict:
    """The windows packed as --pack packs them, all sizes seen first: its rows' padding."""
    import numpy as np
    from training import packing
    sizes = np.array([len(window) - 1 for window in windows])
    _, per_row = packing.best_fit_decreasing(sizes, seq_len, seed=0)
    return {"rows": len(per_row), "padding": 1 - sizes.sum() / (len(per_row) * seq_len),
            "most_windows": int(per_row.max())}


def map_style_bpe(path: str, vocab_size: int) -> dict:
    """The BPE as the scripts train it today, from the file on."""
    import data
    from benchmarks import bench_data
    from training import config, run_data
    cache, start = bench_data.fresh_cache(), time.perf_counter()
    try:
        cfg = config.parse_args(["--dataset", path, "--vocab-size", str(vocab_size)])
        train_text, val_text, _ = run_data.load_text(cfg)
        loaded = time.perf_counter()
        tokenizer = data.train_tokenizer(train_text, cfg.vocab_size)  # as run_data.get_tokenizer trains it
        return {"held_out": len(val_text), "read_s": loaded - start, "bpe_s": time.perf_counter() - loaded,
                "tokenizer": tokenizer.to_str()}
    finally:
        shutil.rmtree(cache, ignore_errors=True)


def stream_bpe(path: str, vocab_size: int) -> dict:
    """The BPE as --stream trains it, from the file on."""
    from training.stream import holdout, shards
    start = time.perf_counter()
    found = shards.find_shards(path, "text")
    held, held_out = holdout.validation_documents(path, found, "text")
    read = time.perf_counter()
    tokenizer = holdout.train_stream_tokenizer(path, found, "text", vocab_size, held_out)
    return {"held_out": len(held), "read_s": read - start, "bpe_s": time.perf_counter() - read,
            "tokenizer": tokenizer.to_str()}


def in_fresh_process(fn, *args) -> dict:
    """fn(*args) in a process of its own (spawned: no memory of this one's), with its peak RSS."""
    import concurrent.futures
    import multiprocessing
    with concurrent.futures.ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(_measured, fn, *args).result()


def _measured(fn, *args) -> dict:
    import resource
    import datasets
    datasets.logging.set_verbosity_error()
    datasets.disable_progress_bars()
    return {**fn(*args), "peak_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def bpe_table(path: Path, vocab_size: int) -> dict:
    print(f"\nThe BPE of {vocab_size:,} tokens, trained from the file (a fresh process each)")
    print(f"  {'path':<12}{'held out':>10}{'read':>9}{'BPE':>9}{'total':>9}{'peak RSS':>11}")
    results = {}
    for name, fn in (("map-style", map_style_bpe), ("stream", stream_bpe)):
        row = results[name] = in_fresh_process(fn, str(path), vocab_size)
        print(f"  {name:<12}{row['held_out']:10,}{row['read_s']:8.1f}s{row['bpe_s']:8.1f}s"
              f"{row['read_s'] + row['bpe_s']:8.1f}s{row['peak_mb']:8,.0f} MB", flush=True)
    return results


def main(argv=None) -> dict:
    """Prints the tables; returns {seq_len: {"offline": ..., open_rows: ..., "rows_per_s": {"padded", "packed"}},
    "bpe": {...}, "loader": {seq_len: {...}}, "checkpoint": {seq_len: {...}}, "integrity": {...},
    "launch": {mb (None for --data): {launch: {...}}}}."""
    args = parse_args(argv)
    import datasets
    from benchmarks import bench_data, stream_state
    from training import tokenized
    datasets.logging.set_verbosity_error()
    datasets.disable_progress_bars()

    path = bench_data.prepared_corpus(args)
    texts = bench_data.read_texts(path)  # a damaged corpus: one line, before any section
    results = {}
    if "bpe" in args.sections:
        results["bpe"] = bpe_table(path, args.vocab_size)
    if "launch" in args.sections:
        from benchmarks import stream_launch
        results["launch"] = stream_launch.table(args, bench_data.bpe(path, args.vocab_size, texts))
    if not {"packer", "loader", "checkpoint", "integrity"} & set(args.sections):
        return results
    tokenizer = tokenized.load_tokenizer(bench_data.bpe(path, args.vocab_size, texts))
    print(f"{path.name}: {len(texts):,} documents, {sum(len(t.encode()) for t in texts) / 1e6:.0f} MB of text | "
          f"BPE of {tokenizer.get_vocab_size():,} tokens", flush=True)
    if "loader" in args.sections:
        results["loader"] = stream_state.loader_table(path, tokenizer, args.seq_lens)
    if "checkpoint" in args.sections:
        results["checkpoint"] = stream_state.checkpoint_table(path, tokenizer, args.seq_lens, args.steps)
    if "integrity" in args.sections:
        from benchmarks import stream_integrity
        results["integrity"] = stream_integrity.table(path, tokenizer, args.seq_lens[0])
    if "packer" not in args.sections:
        return results
    for seq_len in args.seq_lens:
        windows = stream_windows(texts, tokenizer, seq_len)
        best = offline(windows, seq_len)
        results[seq_len] = {"offline": best}
        print(f"\n--seq-len {seq_len}: {len(windows):,} windows, {sum(map(len, windows)) - len(windows):,} tokens")
        print(f"  {'packing':<14}{'rows':>10}{'in stream':>11}{'with flush':>12}{'vs offline':>12}"
              f"{'most windows':>14}{'windows/s':>12}")
        print(f"  {'offline':<14}{best['rows']:10,}{best['padding']:11.2%}{best['padding']:12.2%}{'':>12}"
              f"{best['most_windows']:14,}")
        for open_rows in args.open_rows:
            row = results[seq_len][open_rows] = online(windows, seq_len, open_rows)
            print(f"  {f'online {open_rows}':<14}{row['rows']:10,}{row['in_stream']:11.2%}{row['padding']:12.2%}"
                  f"{(row['in_stream'] - best['padding']) * 100:+12.2f}{row['most_windows']:8,} of {row['bound']:<3,}"
                  f"{row['windows_per_s']:12,.0f}", flush=True)
    print("\none sub-stream's rows a second, on one core:")
    for seq_len in args.seq_lens:
        made = results[seq_len]["rows_per_s"] = {
            framing: sub_stream_rows_per_s(path, tokenizer, seq_len, pack=framing == "packed")
            for framing in ("padded", "packed")}
        print(f"  --seq-len {seq_len}: {made['padded']:7,.0f} padded {made['packed']:7,.0f} packed", flush=True)
    return results


if __name__ == "__main__":
    from training import stopping
    stopping.exit_on_usage_error(main)  # bad flags: one line, exit status 2
