"""Measure --pack against one window a row, side by side in one run, on a FineWeb-shaped corpus.

    python bench_packing.py                      # CPU: the tiny model; GPU: the article model, compiled, bf16
    python bench_packing.py --seq-lens 512 1024 --mb 200

The corpus is bench_data.py's (generated once, FineWeb's shape: log-normal document lengths,
median about 1,800 characters) with its 50,000-token BPE. For each --seq-len, two layouts of
the same windows: padded (one window a row, the default) and packed (--pack):
  preparation   run_data.Corpus + training_rows on a fresh `datasets` cache, as the
                trainers call them: packing adds its step to the same work, timed alone too
  padding       the share of an epoch's positions that hold no token
  loader        rows a second through the DataLoader as the trainers build it
  training      optimizer steps of --batch-size rows (the model, dtype and compile of the
                machine's default above), on batches drawn from each layout: positions/s
                counts every position of the rows, real tokens/s only those with a target.
                The two layouts take turns, --rounds times, each step on a batch of its
                own; each figure is the median round.
"""

import argparse
import os
import statistics
import time
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root, from any folder


def parse_args(argv=None):
    import torch
    from benchmarks import bench, bench_data
    from model import PRESETS
    from training.errors import ArgumentParser, at_least
    cuda = torch.cuda.is_available()
    p = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seq-lens", type=at_least(1), nargs="+", default=[512, 1024])
    p.add_argument("--model", default="article" if cuda else "tiny", choices=sorted(PRESETS), help="model preset")
    p.add_argument("--batch-size", type=at_least(1), default=64 if cuda else 8, help="rows a step, in both layouts")
    p.add_argument("--steps", type=at_least(1), default=10 if cuda else 4, help="timed steps a round")
    p.add_argument("--rounds", type=at_least(1), default=5 if cuda else 3, help="turns each layout takes")
    bench_data.add_corpus_arguments(p, megabytes=200)
    args = p.parse_args(argv)
    for seq_len in args.seq_lens:  # before the corpus and its BPE are made: a minute
        bench.check_shape(args.model, seq_len, args.batch_size, 1)
    bench_data.check_data(args)
    return args


def prepare(path, tokenizer_path, seq_len, pack):
    """The training rows as the trainers make them, on a fresh cache: (seconds, of which packing's, train)."""
    from benchmarks import bench_data
    from training import config, packing, run_data, tokenized
    cfg = config.parse_args(["--dataset", str(path), "--seq-len", str(seq_len), "--tokenizer", str(tokenizer_path),
                               *(["--pack"] if pack else [])])
    bench_data.fresh_cache()
    timings, real_pack = [], packing.pack

    def timed_pack(*args, **kwargs):  # the packing step alone: two whole preparations differ by more noise
        start = time.perf_counter()
        result = real_pack(*args, **kwargs)
        timings.append(time.perf_counter() - start)
        return result
    packing.pack = timed_pack
    try:
        start = time.perf_counter()
        train = run_data.Corpus(cfg).training_rows(tokenized.load_tokenizer(tokenizer_path))
        return time.perf_counter() - start, sum(timings), train
    finally:
        packing.pack = real_pack


def batches(dataset, batch_size, n, device):
    """n shuffled batches of the layout, on the device: (x, y), packed rows' with their position_ids and cu_seqlens."""
    import torch
    import data
    from training import read_ahead
    loader = torch.utils.data.DataLoader(dataset, batch_size=batch_size, sampler=data.ResumableRandomSampler(dataset, 0),
                                         drop_last=True)
    return [read_ahead.on_device(batch, device) for batch, _ in zip(loader, range(n))]


def trainer(args, vocab_size, seq_len, device):
    """One optimizer step of the model the trainers build, on a batch: step(x, y, *packing);
    the dtype it computes in, and its FLOPs a token (metrics' count, for MFU)."""
    import torch
    from training import build, config, launch
    cfg = config.parse_args(["--model", args.model, "--seq-len", str(seq_len)])
    dtype = launch.compute_dtype("auto", device)
    model = build.model(cfg, vocab_size, dtype, device)
    if device.type == "cuda":
        model.compile()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda")

    def step(x, y, *packing):
        loss_sum, n = model(x, y, *packing)
        (loss_sum.sum() / n.sum()).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return step, dtype, model.flops_per_token(seq_len)


def timed_round(step, batches, device):
    """(positions/s, real tokens/s) over a step on each batch."""
    import torch
    positions = tokens = 0
    start = time.perf_counter()
    for x, y, *packing in batches:
        step(x, y, *packing)
        positions, tokens = positions + y.numel(), tokens + (y != -100).sum()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    seconds = time.perf_counter() - start
    return positions / seconds, int(tokens) / seconds


def attention_seconds(model: str, dtype, position_ids, cu_seqlens, repeats: int = 5) -> dict:
    """Seconds of one layer's attention forward and backward on random q, k, v of the model's
    heads, with the packed rows' real position_ids and cu_seqlens: padded rows' is_causal kernel,
    packed rows' paths (packed_attention.attention: on CUDA flex, and varlen where this torch
    serves it, the two kernels --packed-attention chooses between; query blocks on a CPU), and
    the plain formulation they replace (one call under the whole mask); and of making the packed
    rows' mask, which the model does once a forward for all its layers. The median of `repeats`."""
    import torch
    import torch.nn.functional as F
    from ops import packed_attention
    from model import PRESETS
    shape = PRESETS[model]
    B, T = position_ids.shape
    H, K = shape["num_attention_heads"], shape["num_key_value_heads"]
    D = shape["hidden_size"] // H
    device = position_ids.device
    q, k, v = (torch.randn(B, n, T, D, device=device, dtype=dtype, requires_grad=True) for n in (H, K, K))
    mask = packed_attention.window_mask(position_ids, dtype)  # a BlockMask on CUDA, a tensor on a CPU
    dense = packed_attention.window_mask(position_ids.cpu(), dtype).to(device)  # a tensor on every device
    paths = {"is_causal (padded)": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True),
             f"{'flex' if device.type == 'cuda' else 'query blocks'} (packed)":
                 lambda: packed_attention.attention(q, k, v, mask)}
    if device.type == "cuda" and packed_attention.varlen_with_gqa():
        windows = packed_attention.window_mask(position_ids, dtype, cu_seqlens)
        paths["varlen (packed)"] = lambda: packed_attention.attention(q, k, v, windows)
    paths["one call under the mask"] = lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=dense, enable_gqa=True)
    seconds = {name: median_seconds(lambda: attend().sum().backward(), device, repeats) for name, attend in paths.items()}
    seconds["making the packed mask"] = median_seconds(lambda: packed_attention.window_mask(position_ids, dtype),
                                                       device, repeats)
    return seconds


def median_seconds(work, device, repeats: int) -> float:
    """The median seconds of work() over `repeats` calls, after one untimed (it compiles flex on CUDA)."""
    import torch
    times = []
    for _ in range(repeats + 1):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        work()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:])


def main():
    args = parse_args()
    os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")
    import datasets
    import torch
    from benchmarks import bench_data
    from training import metrics, tokenized
    datasets.logging.set_verbosity_error()
    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")

    path = bench_data.prepared_corpus(args)
    tokenizer_path = bench_data.bpe(path, args.vocab_size)  # bench_data.py's, trained once
    vocab_size = tokenized.load_tokenizer(tokenizer_path).get_vocab_size()
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU, {torch.get_num_threads()} threads"
    print(f"{path.name} | BPE of {vocab_size:,} | {where} | torch {torch.__version__} | --model {args.model}, "
          f"{args.batch_size} rows a step", flush=True)

    for seq_len in args.seq_lens:
        layouts = {}
        for name, pack in (("padded", False), ("packed", True)):
            seconds, packing, train = prepare(path, tokenizer_path, seq_len, pack)
            layouts[name] = {"prep_s": seconds, "pack_s": packing, "facts": train.facts, "train": train,
                             "loader_rows_per_s": bench_data.loader_rows_per_s(train, args.batch_size, seconds=5.0)}
        step, dtype, flops_per_token = trainer(args, vocab_size, seq_len, device)
        for layout in layouts.values():  # every step a batch of its own: a fair sample of the padding
            layout["batches"] = batches(layout["train"], args.batch_size, 2 + args.steps * args.rounds, device)
            for x, y, *packing in layout["batches"][:2]:  # warm-up (and compile) untimed
                step(x, y, *packing)
            layout["rounds"] = []
        for r in range(args.rounds):  # the layouts take turns: the machine's drift falls on both
            for layout in layouts.values():
                timed = layout["batches"][2 + r * args.steps:2 + (r + 1) * args.steps]
                layout["rounds"].append(timed_round(step, timed, device))

        print(f"\n--seq-len {seq_len}, {dtype}{', compiled' if device.type == 'cuda' else ''}")
        print(f"  {'layout':<8}{'prep s':>8}{'rows':>11}{'padding':>9}{'loader rows/s':>15}{'positions/s':>13}"
              f"{'real tokens/s':>15}")
        for name, layout in layouts.items():
            positions, tokens = (statistics.median(r[i] for r in layout["rounds"]) for i in (0, 1))
            layout.update(positions_per_s=positions, tokens_per_s=tokens)
            print(f"  {name:<8}{layout['prep_s']:8.1f}{layout['facts']['rows']:11,}{layout['facts']['padding']:9.1%}"
                  f"{layout['loader_rows_per_s']:15,.0f}{positions:13,.0f}{tokens:15,.0f}")
        padded, packed = layouts["padded"], layouts["packed"]
        # the timed batches are a sample of the epoch's rows, and their padding varies: over a
        # whole epoch, a layout trains its positions/s times the share of them that are tokens
        epoch = [layout["positions_per_s"] * (1 - layout["facts"]["padding"]) for layout in (padded, packed)]
        print(f"  packing: {packed['pack_s']:.1f} s, {packed['pack_s'] / padded['prep_s']:.1%} of the padded preparation")
        print(f"  packed vs padded: preparation {packed['prep_s'] / padded['prep_s']:.2f}x the time, positions/s "
              f"{packed['positions_per_s'] / padded['positions_per_s']:.2f}x, real tokens/s "
              f"{packed['tokens_per_s'] / padded['tokens_per_s']:.2f}x (over an epoch's padding: "
              f"{epoch[1] / epoch[0]:.2f}x)")
        attention = attention_seconds(args.model, dtype, *packed["batches"][0][2:])
        print(f"  attention alone, a layer's forward and backward ({args.batch_size} rows, the model's heads), and the "
              f"packed mask (once a forward): "
              + ", ".join(f"{name} {s * 1e3:.1f} ms" for name, s in attention.items()))
        peak = metrics.peak_tflops(device, dtype)
        if peak:  # a GPU whose bf16 peak metrics knows; the trainers' count of FLOPs a token, in both
            print(f"  MFU on real tokens: padded {padded['tokens_per_s'] * flops_per_token / 1e12 / peak:.1%}, "
                  f"packed {packed['tokens_per_s'] * flops_per_token / 1e12 / peak:.1%}")


if __name__ == "__main__":
    from training import stopping
    stopping.exit_on_usage_error(main)  # bad flags: one line, exit status 2
