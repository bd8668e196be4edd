"""Measure the memory of one training step, by how the LM head's loss and the activations are
kept, and estimate the largest micro-batch that fits one GPU.

    python bench_memory.py                         # article preset, 8 x 512 and 16 x 512, fp32
    python bench_memory.py --batch 4 8 --dtype bf16 --gpu-gb 80

Table 1 measures each row in a fresh process, one micro-batch of --batch x --seq-len tokens:
  decoder alone        forward and backward of the decoder without LM head and loss: the
                       floor that the head and the loss add to
  full logits          the LM head's loss as it was: every logit at once, then F.cross_entropy
  chunked loss         ours, the default (chunked_loss.py)
  + act. checkpointing the chunked loss and --activation-checkpointing
Memory is the peak above the process with its model built: on a CPU its peak RSS (glibc is
told to return freed memory at once, MALLOC_MMAP_THRESHOLD_, so that the peak is the
tensors' own and not the allocator's leftovers), on a GPU torch's max allocated. It is taken
after forward and backward, then after AdamW's step, whose two moments (8 bytes a
parameter) come with the first step. The time is one step's, the best of --steps, with the
rows' processes taking turns. Table 2 gives each row's bytes a token (from the two largest
batches) beside memory.py's estimate, and Table 3 the largest micro-batch of 512 tokens that
fits --gpu-gb for the article and 1b presets under DDP and FSDP, from memory.py's estimate
(an estimate: no run of that size is made; searched up to 4,096 sequences, and a row that
reaches it says "at least 4096"). Table 4, from the same estimate, what each rank holds under
train_tp.py for those presets at --tp 1, 2, 4 and 8, with dp 1 and with FSDP over the rest of
8 GPUs: fp32 weights, gradients and AdamW's moments, the activations of one micro-batch of
--batch's first x --seq-len tokens a TP group, and the loss's logits (the chunked loss's chunk
at tp 1, loss_parallel's whole (tokens, V/tp) at the peak of its backward beyond). Table 5, the
same per rank for published models that --init-from imports (their config.json's sizes), under
DDP and under FSDP over 8 GPUs; --hf-config FOLDER adds a Hugging Face model folder's own.
"""

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root, from any folder

VARIANTS = {"decoder alone": [], "full logits": [], "chunked loss": [], "+ act. checkpointing": []}


def parse_args(argv=None):
    from model import PRESETS
    from training.errors import ArgumentParser, at_least, path_argument
    p = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="article", choices=sorted(PRESETS),
                   help="model preset (vocabulary: the training preset's)")
    p.add_argument("--batch", type=at_least(1), nargs="+", default=[8, 16], help="micro-batches to measure, in sequences")
    p.add_argument("--seq-len", type=at_least(1), default=512)
    p.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    p.add_argument("--steps", type=at_least(1), default=2, help="timed steps per row and batch (after one untimed)")
    p.add_argument("--gpu-gb", type=at_least(1e-3, float), default=24.0, help="GPU memory for Table 3, in GB")
    p.add_argument("--estimate-only", action="store_true", help="Table 3 alone: no measurement")
    p.add_argument("--json", type=path_argument, default="bench_memory.json")
    p.add_argument("--hf-config", type=path_argument, nargs="*", default=[],
                   help="Hugging Face model folders to add to Table 5 (their config.json)")
    p.add_argument("--one", nargs=3, metavar=("VARIANT", "BATCH", "VOCAB"), help=argparse.SUPPRESS)  # a worker's row
    args = p.parse_args(argv)
    if not args.one:  # (a worker's row: its parent checked the flags)
        from benchmarks.bench import check_shape
        from training import files
        check_shape(args.model, args.seq_len, min(args.batch), 1)
        if not args.estimate_only:  # before the rows are measured
            files.check_output(args.json, "--json")
    return args


def peak_bytes(device) -> int:
    import torch
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:")) * 1024


def measure_one(args, variant: str, batch: int, vocab_size: int) -> dict:
    """One row in this (fresh) process: peak memory above the built model, and step time. (The
    vocabulary from the parent: training.config would import `datasets` into every row.)"""
    import torch
    import torch.nn.functional as F

    from model import IGNORE_INDEX, PRESETS, LlamaConfig, LlamaForPretraining
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    torch.manual_seed(0)
    model = LlamaForPretraining(LlamaConfig(vocab_size=vocab_size, **PRESETS[args.model])).to(device)
    model.compute_dtype = dtype
    if variant == "+ act. checkpointing":
        model.enable_activation_checkpointing()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda")
    x = torch.randint(3, vocab_size, (batch, args.seq_len + 1), device=device)
    x, y = x[:, :-1], x[:, 1:]

    def loss():
        if variant == "decoder alone":
            with torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32):
                return model.base_model(x).float().square().mean()
        if variant == "full logits":  # the formulation chunked_loss.py replaces
            with torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32):
                logits = torch.nn.Linear.forward(model.lm_head, model.base_model(x))
            return F.cross_entropy(logits.float().flatten(0, 1), y.flatten(), ignore_index=IGNORE_INDEX)
        loss_sum, n_tokens = model(x, y)
        return loss_sum.sum() / n_tokens.sum()

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    built = peak_bytes(device)
    times = []
    for step in range(1 + args.steps):
        start = time.perf_counter()
        loss().backward()
        if step == 0:
            after_backward = peak_bytes(device) - built
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if step == 0:
            after_step = peak_bytes(device) - built
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    return {"built": built, "backward": after_backward, "step": after_step, "seconds": min(times[1:] or times),
            "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"}


def run_row(args, variant: str, batch: int) -> dict:
    """A fresh process for one row: a process's peak RSS never goes down."""
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "131072"}
    from training.config import TRAINING_PRESETS
    vocab_size = TRAINING_PRESETS[args.model]["vocab_size"]
    cmd = [sys.executable, __file__, "--one", variant, str(batch), str(vocab_size), "--model", args.model,
           "--seq-len", str(args.seq_len), "--dtype", args.dtype, "--steps", str(args.steps)]
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, check=True).stdout
    return json.loads(out.splitlines()[-1])


def estimates_per_token(args) -> dict:
    import torch

    from model import PRESETS, LlamaConfig
    from training import memory
    from training.config import TRAINING_PRESETS
    config = LlamaConfig(vocab_size=TRAINING_PRESETS[args.model]["vocab_size"], **PRESETS[args.model])
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    return {"chunked loss": memory.activation_bytes_per_token(config, dtype),
            "+ act. checkpointing": memory.activation_bytes_per_token(config, dtype, checkpointing=True)}


def print_fits(args, fits):
    print(f"\nTable 3: the largest micro-batch of {args.seq_len} tokens on a {args.gpu_gb:g} GB GPU, in {args.dtype} "
          "(memory.py's estimate: weights, gradients and AdamW state, activations, one chunk of logits)")
    for preset, how, checkpointing, batch in fits:
        largest = f"at least {batch}" if batch == LARGEST_SEARCHED else batch  # the search stopped there, not the GPU
        print(f"  {preset:<8}{how:<16}{'with' if checkpointing else 'without':>8} activation checkpointing: "
              f"{largest:>5}")


LARGEST_SEARCHED = 4096  # micro-batches: a batch of this size that fits is reported as "at least" it


def fits_table(args) -> list:
    """The largest micro-batch of seq_len tokens whose estimate (memory.py) fits --gpu-gb, up to
    LARGEST_SEARCHED."""
    import torch

    from model import PRESETS, LlamaConfig
    from training import memory
    from training.config import TRAINING_PRESETS
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    rows = []
    for preset in ("article", "1b"):
        config = LlamaConfig(vocab_size=TRAINING_PRESETS[preset]["vocab_size"], **PRESETS[preset])
        for ranks in (1, 2, 4, 8):
            for checkpointing in (False, True):
                def need(batch):
                    return memory.estimate(config, batch, args.seq_len, dtype, shards=ranks, on_gpu=True,
                                           checkpointing=checkpointing).total
                batch, too_many = 0, LARGEST_SEARCHED + 1  # the estimate grows with the batch: bisect
                while too_many - batch > 1:
                    middle = (batch + too_many) // 2
                    batch, too_many = (middle, too_many) if need(middle) <= args.gpu_gb * 1e9 else (batch, middle)
                rows.append((preset, "DDP" if ranks == 1 else f"FSDP, {ranks} ranks", checkpointing, batch))
    return rows


TP_DEGREES = (1, 2, 4, 8)
GPUS = 8  # a node's: the second layout of Table 4 spreads FSDP over the rest of them
# Tables 4 and 5's columns: (the row's key, its width, its heading), in GB
PER_RANK = (("weights", 9, "weights"), ("gradients", 8, "grads"), ("optimizer", 8, "AdamW"),
            ("activations", 13, "activations"), ("logits", 7, "loss"), ("total", 8, "total"))


def per_rank_row(need, **labels) -> dict:
    """A row of Tables 4 and 5 from memory.estimate's answer: its fp32 weights (4 bytes of the 16
    a parameter holds), as many bytes of gradients, twice that of AdamW's moments, then the
    activations, the loss's logits and the total; labels first (model, tp, dp)."""
    from training import memory
    weights = need.state // (memory.BYTES_PER_PARAMETER // 4)
    return {**labels, "weights": weights, "gradients": weights, "optimizer": 2 * weights,
            "activations": need.activations, "logits": need.logits, "total": need.total}


def per_rank_heading() -> str:
    return "".join(f"{heading:>{width}}" for _, width, heading in PER_RANK)


def per_rank_cells(row: dict) -> str:
    return "".join(f"{row[key] / 1e9:>{width}.2f}" for key, width, _ in PER_RANK)


def tp_table(args) -> list:
    """memory.py's estimate per rank under train_tp.py, for the article and 1b presets at each
    of TP_DEGREES, with dp 1 and with dp = GPUS / tp: one micro-batch of --batch's first x
    --seq-len tokens a TP group, on a GPU (fused AdamW, saves in host memory)."""
    import torch

    from model import PRESETS, LlamaConfig
    from training import memory, tensor_parallel
    from training.config import TRAINING_PRESETS
    from training.errors import UsageError
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    rows = []
    for preset in ("article", "1b"):
        config = LlamaConfig(vocab_size=TRAINING_PRESETS[preset]["vocab_size"], **PRESETS[preset])
        for tp in TP_DEGREES:
            try:
                tensor_parallel.check_model(config, tp)
            except UsageError as refused:
                rows.append({"model": preset, "tp": tp, "refused": str(refused)})
                continue
            for dp in sorted({1, GPUS // tp}):
                need = memory.estimate(config, args.batch[0], args.seq_len, dtype, shards=dp * tp, on_gpu=True, tp=tp)
                rows.append(per_rank_row(need, model=preset, tp=tp, dp=dp))
    return rows


def print_tp(args, rows):
    print(f"\nTable 4: per rank under train_tp.py (memory.py's estimate, GB), one micro-batch of {args.batch[0]} x "
          f"{args.seq_len} tokens a TP group, {args.dtype}, on GPUs; dp {GPUS} / tp: FSDP over the rest of {GPUS}")
    print(f"  {'model':<9}{'tp':>3}{'dp':>4}{per_rank_heading()}")
    for row in rows:
        if "refused" in row:
            print(f"  {row['model']:<9}{row['tp']:>3}    refused: {row['refused']}")
            continue
        print(f"  {row['model']:<9}{row['tp']:>3}{row['dp']:>4}{per_rank_cells(row)}")


# The sizes in the published models' config.json (Hugging Face Hub): what memory depends on
PUBLISHED = {
    "SmolLM2-135M": dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                         num_attention_heads=9, num_key_value_heads=3, tie_word_embeddings=True),
    "SmolLM2-360M": dict(vocab_size=49152, hidden_size=960, intermediate_size=2560, num_hidden_layers=32,
                         num_attention_heads=15, num_key_value_heads=5, tie_word_embeddings=True),
    "Llama-3.2-1B": dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                         num_attention_heads=32, num_key_value_heads=8, tie_word_embeddings=True),
}


def published_table(args) -> list:
    """memory.py's estimate per rank for PUBLISHED and --hf-config's models, one micro-batch of
    --batch's first x --seq-len tokens a rank, on a GPU: DDP, and FSDP over GPUS ranks."""
    import torch

    from model import LlamaConfig
    from training import hf_import, memory
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    configs = {name: LlamaConfig(max_position_embeddings=args.seq_len, **sizes) for name, sizes in PUBLISHED.items()}
    configs.update({Path(folder).name: hf_import.llama_config(Path(folder)) for folder in args.hf_config})
    rows = []
    for name, config in configs.items():
        for ranks in (1, GPUS):
            need = memory.estimate(config, args.batch[0], args.seq_len, dtype, shards=ranks, on_gpu=True)
            rows.append(per_rank_row(need, model=name, tp=1, dp=ranks))
    return rows


def print_published(args, rows):
    print(f"\nTable 5: published models (--init-from), per rank (memory.py's estimate, GB), one micro-batch of "
          f"{args.batch[0]} x {args.seq_len} tokens, {args.dtype}, on GPUs: DDP (dp 1), FSDP over {GPUS} (dp {GPUS})")
    print(f"  {'model':<14}{'dp':>4}{per_rank_heading()}")
    for row in rows:
        print(f"  {row['model']:<14}{row['dp']:>4}{per_rank_cells(row)}")


def main(argv=None):
    args = parse_args(argv)
    if args.one:
        print(json.dumps(measure_one(args, args.one[0], int(args.one[1]), int(args.one[2]))))
        return
    if args.estimate_only:
        print_fits(args, fits_table(args))
        print_tp(args, tp_table(args))
        print_published(args, published_table(args))
        return
    results = {}
    for batch in args.batch:
        for variant in VARIANTS:  # the rows take turns, so that a noisy moment hits them alike
            results[variant, batch] = run_row(args, variant, batch)
    device = next(iter(results.values()))["device"]
    print(f"{device} | {args.model} preset | {args.dtype} | micro-batches of {args.batch} x {args.seq_len} tokens\n")
    built = max(r["built"] for r in results.values()) / 2**30
    print(f"Table 1: peak memory of one step above the built model (the process with its model built: "
          f"{built:.2f} GiB), and the time of a step")
    print(f"  {'':24}" + "".join(f"{f'{b} x {args.seq_len}: fwd+bwd':>22}{'+ AdamW':>9}{'s/step':>8}"
                                 for b in args.batch))
    for variant in VARIANTS:
        cells = "".join(f"{r['backward'] / 2**30:>22.2f}{r['step'] / 2**30:>9.2f}{r['seconds']:>8.2f}"
                        for r in (results[variant, b] for b in args.batch))
        print(f"  {variant:<24}{cells}")
    small, large = sorted(args.batch)[-2:] if len(args.batch) > 1 else (None, args.batch[0])
    per_token = {}
    if small:
        print(f"\nTable 2: bytes a token, from {small} and {large} sequences, beside memory.py's estimate")
        estimated = estimates_per_token(args)
        for variant in VARIANTS:
            grow = results[variant, large]["backward"] - results[variant, small]["backward"]
            per_token[variant] = grow / ((large - small) * args.seq_len)
            guess = f"{estimated[variant]:>14,}" if variant in estimated else ""
            print(f"  {variant:<24}{per_token[variant]:>12,.0f}{guess}")
    base = results["full logits", large]
    print(f"\nAt {large} x {args.seq_len}, against the full logits: chunked loss "
          f"{base['seconds'] / results['chunked loss', large]['seconds']:.2f}x the speed, "
          f"{(base['backward'] - results['chunked loss', large]['backward']) / 2**30:.2f} GiB less; "
          f"with activation checkpointing {base['seconds'] / results['+ act. checkpointing', large]['seconds']:.2f}x, "
          f"{(base['backward'] - results['+ act. checkpointing', large]['backward']) / 2**30:.2f} GiB less")
    fits, tp_rows = fits_table(args), tp_table(args)
    print_fits(args, fits)
    print_tp(args, tp_rows)
    published = published_table(args)
    print_published(args, published)
    from training import files  # here: the rows' processes import no more than they measure
    files.atomic_save(json.dumps({"args": vars(args), "rows": {f"{v} @ {b}": r for (v, b), r in results.items()},
                                  "bytes_per_token": per_token, "fits": fits, "largest_searched": LARGEST_SEARCHED,
                                  "tensor_parallel": tp_rows, "published": published},
                                 indent=2), Path(args.json))
    print(f"\nwritten to {args.json}")


if __name__ == "__main__":
    from training import stopping
    stopping.exit_on_usage_error(main)  # bad flags: one line, exit status 2
