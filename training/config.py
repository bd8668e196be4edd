"""The flags of the three scripts: one typed dataclass, TrainConfig, whose
fields declare their defaults, their bounds and whether a resumed run must keep them;
the presets of --model; and the checks that run before anything else does.
"""

import dataclasses
import importlib
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch

import data
from model import PRESETS, LlamaConfig
from ops import packed_attention
from training import corpus, hf_import, run_folder, tokenized, weights
from training.errors import ArgumentParser, UsageError, warn
from training.launch import check_launch_environment, data_parallel_units
from training.stream import run as stream_run


def flag(default, help, minimum=None, maximum=None, number=None, same_on_resume=False, only=None,
         **argparse_kwargs):
    """A field of TrainConfig and the flag that sets it. minimum, maximum: the bounds of a
    number; number: "positive" or "non-negative" for a float; same_on_resume: a resumed run
    must keep the value (it decides the model, the data, the global batch or the LR
    schedule); only: "distributed" for a flag of the torchrun scripts alone (train_ddp.py,
    train_fsdp.py, train_tp.py), "sharded" for train_fsdp.py's alone, "tensor" for train_tp.py's."""
    return field(default=default, metadata=dict(help=help, minimum=minimum, maximum=maximum, number=number,
                                                 only=only, same_on_resume=same_on_resume,
                                                 argparse=argparse_kwargs))


PROFILE_DEFAULTS = {"profile_warmup": 3, "profile_steps": 2}
DEFAULT_EPOCHS = 3
PROFILE_MAX_STEPS = 10  # a trace's size, and the memory to read it, grow with every step it holds
# The most --max-steps a run takes. A stream's length to the loop is --max-steps x --batch-size
# rows (stream/dataset.py), which len() holds only up to 2**63 - 1: past that, an OverflowError
# once the data is prepared. 10**12 steps, at a millisecond each, are 32 years: more is a typo,
# refused with the flags, for map-style runs too (whose epochs end them sooner anyway). It
# leaves --batch-size up to 9 million sequences (stream.run.check_flags refuses more).
MAX_STEPS = 10**12


@dataclass
class TrainConfig:
    """Every flag of the three scripts. `None` for a preset-dependent field means "take it
    from TRAINING_PRESETS for --model"."""

    # data
    dataset: str = flag(corpus.EMBEDDED_CORPUS, "Hub dataset id, a local .txt/.jsonl/.json/.parquet file "
                        "or folder of them, or 'stdlib': the embedded corpus (Python's own standard library)")
    dataset_config: str | None = flag(None, "Hub dataset configuration, e.g. sample-10BT", type=str)
    split: str | None = flag(None, "Hub dataset split (default: train)", type=str)
    text_column: str = flag("text", "column that holds the documents")
    val_docs: int | None = flag(None, "documents held out for validation (default: 1%%, at most 1000)", minimum=1,
                                same_on_resume=True, type=int)
    stream: bool = flag(False, "read --dataset's shards (a folder or file of .parquet/.jsonl/.jsonl.gz/.jsonl.zst, "
                        "or a Hub dataset's such files, at the commit the run starts at, which its resumes read) "
                        "as training goes, each rank its own sub-streams, tokenized (and with --pack packed) on "
                        "the fly: nothing prepared before the first step, and a resume exact at any world size "
                        "that divides --sub-streams")
    sub_streams: int | None = flag(None, "--stream: how many sub-streams the shards are dealt into, fixed for the "
                                   "run, which resumes at any world size that divides it (default: 8, or the world "
                                   "size if larger, lowered to divide --batch-size and to the shards' pieces with "
                                   "data)", minimum=1, same_on_resume=True, type=int)
    tokenizer: str | None = flag(None, "tokenizer.json to use instead of training a BPE", type=str)
    vocab_size: int | None = flag(None, "BPE vocabulary size to train", minimum=256 + len(data.SPECIAL_TOKENS),
                                  same_on_resume=True, type=int)  # every byte, plus the special tokens
    # model and batch
    model: str = flag("tiny", "model preset", same_on_resume=True, choices=sorted(PRESETS))
    device: str | None = flag(None, "where to train (default: cuda where torch sees a GPU, else cpu; a machine whose "
                              "NVIDIA GPUs torch cannot see is an error, not a silent run on the CPU)", type=str,
                              choices=["cuda", "cpu"])
    dtype: str = flag("auto", "compute dtype; weights and optimizer state stay fp32. auto: bf16 on GPUs with "
                      "native bf16 and on CPUs with AMX, else fp32", choices=["auto", "fp32", "bf16"])
    compile: bool = flag(False, "torch.compile the model (the inner module, before DDP wraps it)")
    activation_checkpointing: bool = flag(False, "keep only each decoder layer's input for backward and recompute "
                                          "the rest there: less memory, one more forward of the layers")
    seq_len: int | None = flag(None, "tokens per sequence (longer documents are cut into several)", minimum=1,
                               same_on_resume=True, type=int)
    pack: bool = flag(False, "place several sequences in each row, each attending only to itself with positions "
                      "from 0: almost no compute on padding where documents are shorter than --seq-len")
    packed_attention: str | None = flag(None, "the CUDA kernel of --pack's attention: flex (compiled flex attention, "
                                        "the default) or varlen (varlen_attn, torch 2.12 on); benchmarks/"
                                        "bench_packing.py times both on your GPU. A CPU computes either under a mask",
                                        type=str, choices=["flex", "varlen"])
    batch_size: int | None = flag(None, "GLOBAL sequences per optimizer step (all ranks, all micro-batches)",
                                  minimum=1, same_on_resume=True, type=int)
    grad_accum: int = flag(1, "micro-batches per optimizer step", minimum=1)
    # optimization (the article's recipe: README.md)
    epochs: int | None = flag(None, f"passes over the training data (default: {DEFAULT_EPOCHS}; --stream reads its "
                              "shards epoch after epoch until --max-steps)", minimum=1, same_on_resume=True, type=int)
    max_steps: int | None = flag(None, "optimizer steps, at most 10**12; also sets the LR schedule's length "
                                 "(default: --model's preset's, 50 for debug and 250 for tiny, else all epochs; "
                                 "--stream needs it given: a stream has no length)", minimum=1, maximum=MAX_STEPS,
                                 same_on_resume=True, type=int)
    lr: float = flag(1e-3, "peak learning rate", number="positive", same_on_resume=True)
    warmup_steps: int | None = flag(None, "linear warmup from 0.1x to 1x the peak LR, then cosine to 0", minimum=0,
                                    same_on_resume=True, type=int)
    weight_decay: float = flag(0.1, "AdamW weight decay (matrices and embeddings only)", number="non-negative",
                               same_on_resume=True)
    grad_clip: float = flag(1.0, "clip the global gradient L2 norm to this (0: off)", number="non-negative",
                            same_on_resume=True)
    seed: int = flag(1337, "seed for weights, data order and the validation split", minimum=0, maximum=2**63 - 1,
                     same_on_resume=True)  # torch generators take 64-bit seeds; seed + epoch must fit
    # output
    out_dir: str = flag("out", "folder for checkpoint.pt, model.pt, tokenizer.json, config.json, metrics.jsonl")
    save_every: int | None = flag(None, "save a checkpoint every N steps (and at the end)", minimum=1, type=int)
    eval_every: int | None = flag(None, "evaluate on the held-out split every N steps (and at the end)", minimum=1,
                                  type=int)
    log_every: int = flag(10, "log the loss every N steps", minimum=1)
    tensorboard: bool = flag(False, "also write every logged number to OUT/tensorboard/, for `tensorboard --logdir "
                             "OUT` (needs the tensorboard package)")
    wandb: str | None = flag(None, "also log to this Weights & Biases project (needs the wandb package; "
                             "WANDB_MODE=offline keeps the run on disk)", type=str)
    wandb_run: str | None = flag(None, "the W&B run's name (default: one W&B picks)", type=str)
    resume: bool = flag(False, "continue the run in --out-dir from its checkpoint.pt")
    init_from: str | None = flag(None, "start a new run from these weights: an output folder (its model.pt, else "
                                 "its newest checkpoint), a .pt file of one, a train_fsdp.py checkpoint folder, or "
                                 "a Hugging Face Llama's folder (config.json, tokenizer.json, safetensors), whose "
                                 "architecture it is; the optimizer, schedule and data position start afresh, the "
                                 "tokenizer is the weights' own", type=str)
    # Not a flag: an imported model's architecture (its LlamaConfig's fields, its special tokens
    # among them), read from --init-from's Hugging Face folder, and from the run's config.json when
    # it resumes (training/hf_import.py). None: the --model preset's.
    architecture: dict | None = flag(None, "", only="internal")
    stop_at_step: int | None = flag(None, "save and exit after this step; continue later with --resume", minimum=1,
                                    type=int)
    keep_checkpoints: int = flag(2, "numbered checkpoints to keep; checkpoint.pt is always the newest", minimum=1)
    profile: bool = flag(False, "trace --profile-steps steps on every rank into OUT/profile/ (Perfetto, "
                         "chrome://tracing, TensorBoard; on CUDA a memory snapshot too): docs/profiling.md")
    profile_warmup: int | None = flag(None, "steps before the traced ones, not traced (compiling, the allocator, the "
                                      "data feed warm up); default 3", minimum=0, maximum=2**62, type=int)
    profile_steps: int | None = flag(None, "steps to trace; default 2, at most 10 (a step of the tiny demo model is "
                                     "2 MB of trace: docs/profiling.md)", minimum=1, maximum=PROFILE_MAX_STEPS, type=int)
    # distributed (train_ddp.py, train_fsdp.py)
    backend: str | None = flag(None, "process-group backend (default: nccl on CUDA, gloo on CPU)",
                               only="distributed", type=str, choices=["nccl", "gloo"])
    timeout_minutes: float = flag(30.0, "how long a training collective may wait for the slowest rank before "
                                  "the job fails (PyTorch's default is 10)", number="positive", maximum=1e6,
                                  only="distributed")
    data_timeout_minutes: float = flag(24 * 60.0, "how long ranks wait for local rank 0 to download, train the "
                                       "tokenizer and tokenize (hours, for a large corpus on a cold cache)",
                                       number="positive", maximum=1e6, only="distributed")
    # sharded (train_fsdp.py)
    replicas: int = flag(1, "hybrid sharding (HSDP): this many replicas of the model, each sharded over world size / "
                         "replicas ranks, gradients all-reduced across replicas once a step. On several nodes: the "
                         "number of nodes (shard over a node's fast links, replicate over the network)", minimum=1,
                         only="sharded")
    # tensor parallel (train_tp.py)
    tp: int = flag(1, "tensor parallelism: split each layer's matrices over this many ranks (one node's GPUs), and "
                   "shard with FSDP over world size / tp groups of them; 1 is train_fsdp.py's run", minimum=1,
                   only="tensor")


# Defaults that depend on --model. `article` is the article's recipe (README.md); `tiny` is the demo
# that runs with no arguments and finishes in a few minutes on a 2-core CPU; `debug` a short run
# to try a setup (the tests train it).
TRAINING_PRESETS = {
    "debug": dict(vocab_size=4096, seq_len=128, batch_size=16, max_steps=50, warmup_steps=5,
                  save_every=25, eval_every=25),
    "tiny": dict(vocab_size=4096, seq_len=128, batch_size=16, max_steps=250, warmup_steps=25,
                 save_every=100, eval_every=50),
    "article": dict(vocab_size=50000, seq_len=512, batch_size=64, max_steps=None, warmup_steps=1000,
                    save_every=1000, eval_every=1000),
    "1b": dict(vocab_size=50000, seq_len=1024, batch_size=64, max_steps=None, warmup_steps=1000,
               save_every=1000, eval_every=1000),
}


def parse_args(argv=None, distributed: bool = False, sharded: bool = False, tensor: bool = False,
               description: str = "") -> TrainConfig:
    """The flags, checked. distributed: the script runs under torchrun (train_ddp.py,
    train_fsdp.py, train_tp.py) and takes its flags too; sharded: it is train_fsdp.py, and takes
    its own; tensor: it is train_tp.py (--tp)."""
    parser = ArgumentParser(description=description)
    distributed = distributed or sharded or tensor
    kinds = {None, *(["distributed"] if distributed else []), *(["sharded"] if sharded else []),
             *(["tensor"] if tensor else [])}
    for f in dataclasses.fields(TrainConfig):
        if f.metadata["only"] not in kinds:  # a flag a script does not use is refused, never ignored
            continue
        name = "--" + f.name.replace("_", "-")
        if f.type is bool or f.type == "bool":
            parser.add_argument(name, action="store_true", help=f.metadata["help"])
        else:
            kwargs = {"type": type(f.default), **f.metadata["argparse"]}
            parser.add_argument(name, default=f.default, help=f.metadata["help"], **kwargs)
    cfg = TrainConfig(**vars(parser.parse_args(argv)))
    check_launch_environment(one_process=not distributed)  # RANK, WORLD_SIZE...: whole numbers, as torchrun sets them
    for name, value in vars(cfg).items():  # `--init-from "$UNSET"` must not mean "no --init-from"
        if isinstance(value, str) and not value.strip():
            raise UsageError(f"--{name.replace('_', '-')} is empty (an unset variable in a job script?): give it "
                             "a value, or leave the flag out")
    if cfg.tokenizer and cfg.vocab_size is not None:
        raise UsageError("--vocab-size sets the size of a tokenizer to train; --tokenizer brings its own")
    if cfg.init_from and cfg.resume:  # e.g. a job resubmitted with its arguments plus --resume
        warn(f"--init-from {cfg.init_from} is ignored: --resume continues the run in --out-dir from its checkpoint")
        cfg.init_from = None
    if cfg.init_from and (folder := hf_import.resolve(cfg.init_from)):  # a published model (a folder, a Hub id)
        out = source = folder
        architecture = hf_import.llama_config(folder)
        hf_import.check_weights(folder, architecture, weights.model_shapes(architecture))  # from the files' headers
        theirs = tokenized.load_tokenizer(folder / hf_import.TOKENIZER, architecture)  # one token an embedding row
        cfg.architecture = dataclasses.asdict(architecture)  # (trained_seq_len None: --seq-len decides it)
    elif cfg.init_from:
        out, source = weights.init_source(cfg.init_from)
        cfg.architecture = run_folder.imported_architecture(out)  # a run that started from a published model
        theirs = tokenized.load_tokenizer(out / run_folder.TOKENIZER, imported(cfg))
        run_folder.check_tokenizer(out, theirs, run_folder.recorded_fingerprint(out))  # unedited
    if cfg.init_from:
        if cfg.tokenizer:
            raise UsageError("--init-from brings its own tokenizer (the tokenizer.json beside its weights): leave "
                             "--tokenizer out")
        if cfg.vocab_size is not None:  # a job script's constant: fine while it is what the weights were trained on
            if cfg.vocab_size != theirs.get_vocab_size():
                raise UsageError(f"--vocab-size {cfg.vocab_size}: the weights of --init-from were trained with "
                                 f"{theirs.get_vocab_size():,} tokens (their tokenizer.json comes with them): leave --vocab-size out")
            cfg.vocab_size = None
        # resolved once: every later step reads these weights, even if the source run saves again
        cfg.init_from = str(source)
        cfg.tokenizer = str(out / run_folder.TOKENIZER)  # the ids the weights were trained on
    if cfg.resume and cfg.architecture is None:  # an imported model continues as itself (its config.json)
        cfg.architecture = run_folder.imported_architecture(Path(cfg.out_dir))
    if cfg.architecture and "--model" in (arg.split("=")[0] for arg in (sys.argv[1:] if argv is None else argv)):
        raise UsageError(f"--init-from {cfg.init_from or cfg.out_dir} brings its own architecture (its config.json): "
                         "leave --model out")
    for key, value in TRAINING_PRESETS[cfg.model].items():
        # a tokenizer brings its vocabulary; so does a resumed run (its own tokenizer.json). A stream
        # has no length: a demo's 50 or 250 steps of a 100 GB corpus, said nowhere, would be a guess
        # (stream.run.check_flags asks for --max-steps)
        if getattr(cfg, key) is None and not (key == "vocab_size" and (cfg.tokenizer or cfg.resume)) \
                and not (key == "max_steps" and cfg.stream):
            setattr(cfg, key, value)
    validate(cfg)
    if cfg.compile and not distributed and cfg.device != "cpu" and torch.cuda.device_count() > 1:
        raise UsageError("--compile does not work under nn.DataParallel (train_dp.py on several GPUs): use "
                         "train_ddp.py")
    return cfg


def validate(cfg: TrainConfig):
    """Every value within the bounds its field declares, then what no single field knows."""
    for f in dataclasses.fields(cfg):
        value, name = getattr(cfg, f.name), "--" + f.name.replace("_", "-")
        minimum, maximum, number = f.metadata["minimum"], f.metadata["maximum"], f.metadata["number"]
        if minimum is not None and value is not None and value < minimum:
            raise UsageError(f"{name} must be at least {minimum}, got {value}")
        if maximum is not None and value is not None and value > maximum:  # a whole number exactly, with commas
            shown = [f"{v:,}" if isinstance(v, int) else f"{v:g}" for v in (maximum, value)]
            raise UsageError(f"{name} must be at most {shown[0]}, got {shown[1]}")
        if number and not (math.isfinite(value) and (value > 0 if number == "positive" else value >= 0)):
            raise UsageError(f"{name} must be a {number} number, got {value}")
    max_pos = (cfg.architecture or PRESETS[cfg.model])["max_position_embeddings"]
    if cfg.seq_len > max_pos:
        which = "imported" if cfg.architecture else cfg.model
        raise UsageError(f"--seq-len {cfg.seq_len} exceeds the {which} model's {max_pos} positions")
    if cfg.backend == "nccl" and (cfg.device == "cpu" or not torch.cuda.is_available()):
        raise UsageError("--backend nccl needs CUDA GPUs, and this run has none (none visible, or --device cpu): "
                         "leave --backend out (gloo on CPUs)")
    if cfg.packed_attention and not cfg.pack:
        raise UsageError("--packed-attention chooses the kernel of packed rows: add --pack, or leave it out")
    if cfg.packed_attention == "varlen":
        if cfg.device == "cpu" or not torch.cuda.is_available():
            raise UsageError("--packed-attention varlen is a CUDA kernel, and this run has no GPU (none visible, or "
                             "--device cpu): leave the flag out (a CPU computes packed rows under a mask)")
        if not packed_attention.varlen_with_gqa():
            raise UsageError(f"--packed-attention varlen needs torch 2.12 or newer (varlen_attn serving grouped-query "
                             f"attention), and this is torch {torch.__version__}: use flex, the default")
    given = [name for name in PROFILE_DEFAULTS if getattr(cfg, name) is not None]
    if given and not cfg.profile:  # as --wandb-run without --wandb: a flag that would do nothing
        raise UsageError(f"--{given[0].replace('_', '-')} sets what --profile traces: add --profile, or leave it out")
    for name, default in PROFILE_DEFAULTS.items():
        setattr(cfg, name, default if getattr(cfg, name) is None else getattr(cfg, name))
    if cfg.wandb_run and not cfg.wandb:
        raise UsageError("--wandb-run names a W&B run: give the project too, with --wandb PROJECT")
    # optional packages, imported only when asked for; then before anything is written
    for package in [name for name, wanted in [("tensorboard", cfg.tensorboard), ("wandb", cfg.wandb)] if wanted]:
        try:
            importlib.import_module(package)
        except ImportError:
            raise UsageError(f"--{package} needs the {package} package: pip install {package}") from None
    corpus.check_dataset_flags(cfg.dataset, cfg.dataset_config, cfg.split)
    stream_run.check_flags(cfg)  # after the dataset's own checks: a missing one is said as such
    cfg.epochs = cfg.epochs or DEFAULT_EPOCHS  # (a stream's sub-streams count theirs: --max-steps ends it)
    run_folder.check_writable(cfg.out_dir)
    dataset = Path(cfg.dataset).expanduser()
    inside = dataset.is_dir() and Path(cfg.out_dir).resolve().is_relative_to(dataset.resolve())
    if inside and cfg.dataset != corpus.EMBEDDED_CORPUS:
        raise UsageError(f"--out-dir {cfg.out_dir} is inside the --dataset folder {cfg.dataset}: the run would "
                         "read its own files as data. Choose an --out-dir outside it")


def model_config(cfg: TrainConfig, vocab_size: int) -> LlamaConfig:
    """The model this run trains: --init-from's imported architecture, or the --model preset
    with the tokenizer's vocabulary; trained at --seq-len."""
    if cfg.architecture:
        return LlamaConfig(**{**cfg.architecture, "trained_seq_len": cfg.seq_len})
    return LlamaConfig(vocab_size=vocab_size, trained_seq_len=cfg.seq_len, **PRESETS[cfg.model])


def imported(cfg: TrainConfig) -> LlamaConfig | None:
    """The imported model's config (its special tokens), or None for a --model preset's run."""
    return LlamaConfig(**cfg.architecture) if cfg.architecture else None


def special_ids(cfg: TrainConfig, tokenizer) -> data.SpecialIds:
    """The ids the run frames documents with and pads rows with: the imported model's own, or ours."""
    return data.special_ids(tokenizer, imported(cfg))


def mesh_shape(replicas: int, world_size: int) -> tuple[tuple[int, ...], tuple[str, ...]]:
    """train_fsdp.py's device mesh, its sizes and their names: (world_size,) to shard over
    every rank; with --replicas R, (R, world_size / R): R replicas, each sharded over
    world_size / R consecutive ranks (HSDP)."""
    if world_size % replicas:
        raise UsageError(f"--replicas {replicas} does not divide the world size {world_size}: each replica needs "
                         "the same number of ranks (on N nodes of G GPUs, --replicas N shards over each node)")
    if replicas == 1:
        return (world_size,), ("shard",)
    return (replicas, world_size // replicas), ("replicate", "shard")


def micro_batch_size(cfg: TrainConfig, world_size: int) -> int:
    """Sequences per process and micro-step: the global batch / (world size x grad accum).
    world_size: the ranks that read rows of their own (under TP, the data-parallel groups)."""
    if cfg.batch_size % (world_size * cfg.grad_accum):
        ranks = f"world size {world_size}" if cfg.tp == 1 else f"{world_size} {data_parallel_units(cfg.tp)}"
        raise UsageError(f"--batch-size {cfg.batch_size} is not divisible by {ranks} x --grad-accum {cfg.grad_accum}")
    return cfg.batch_size // (world_size * cfg.grad_accum)


def total_steps(cfg: TrainConfig, steps_per_epoch: int) -> int:
    all_epochs = cfg.epochs * steps_per_epoch
    total = min(cfg.max_steps, all_epochs) if cfg.max_steps else all_epochs
    if cfg.max_steps and cfg.max_steps > all_epochs:  # the run is shorter than asked: say which flag ends it
        asked = f"--max-steps {cfg.max_steps}"
        if cfg.max_steps == TRAINING_PRESETS[cfg.model]["max_steps"]:  # the flag left out: --model's default
            asked += f" (the {cfg.model} preset's)"
        warn(f"{asked} is more than --epochs {cfg.epochs} take ({all_epochs} steps, {steps_per_epoch} an epoch): the "
             f"run trains {all_epochs} steps, its learning rate schedule {all_epochs} steps long. Raise --epochs to "
             f"train {cfg.max_steps}")
    if cfg.warmup_steps >= total:
        warn(f"--warmup-steps {cfg.warmup_steps} is not shorter than the run ({total} steps): the learning rate "
             "is still warming up when the run ends, and never decays")
    return total
