"""A streamed run's data in its checkpoint: what the run reads (its record, which a resume
must find again, or it is one line naming what changed), how many sub-streams it deals its
shards into (--sub-streams), and where those stand (the feed's states, every rank's gathered
into the checkpoint, each rank of a resumed run given those it owns).

The record: a Hub dataset's pin (hub.Pin: its id, config, split and commit, which a resume
reads again; null for local shards, whose path is no part of what they are), the shards (each
one's name, size, digest and pieces: shards.Shard), the text column, the held-out set
(holdout.HeldOut), the sub-stream count S, --seq-len, --pack, --seed and the tokenizer's
fingerprint: what decides which rows each sub-stream yields, so that the states in a checkpoint
mean, on resume, the rows they meant when saved. JSON-able: ints, strs, bools, lists, dicts and
nulls. check_resume reads a record as it would a hostile file (it comes from
one): a field missing, added or of another type is one line, and so is the first thing that
differs.

The sub-streams: S is the run's for good (another S deals other sub-streams), and a run
resumes at any world size that divides it. Its default is DEFAULT_SUB_STREAMS (or the world
size, where that is larger), lowered to a divisor of --batch-size that the world size divides
and to the corpus's pieces with training data. Not the batch size itself, which would resume at
every world size the map-style path allows: each sub-stream costs every step (a packed
sub-stream's state, 0.24 MB at --seq-len 512, comes with its rows from a worker: loader.py) and
in every checkpoint, and the rows dropped at the run's end grow with S (order.py). At 8, a rank
of a node of 8 GPUs receives one state a step and a lone GPU 8 (about 3 ms a step at 512, in
ReadAhead's thread); a checkpoint holds 8 (below); the run resumes at 1, 2, 4 or 8 ranks. A
job of more ranks needs more sub-streams: --sub-streams sets them.

The states: every rank's owned sub-streams' states (StreamFeed.state_dict(), or ReadAhead's: those
of the steps handed to the loop) are gathered with dist.all_gather_object, which pickles them (a
tensor: its storage whole, in torch.save's format, about 0.9 KB more than its bytes; a view would
carry the storage it views: the states own theirs) and unpickles them with pickle: from the job's
own ranks, never from a file. Every rank receives them and rank 0 keeps them: gather_object
(group_dst=0) would send them to rank 0 alone, but the others' copy is brief. Rank 0 saves them
with the rest of the checkpoint, which both formats write there (pt_checkpoint: the .pt file;
sharded_checkpoint: train_state.pt); torch.load(weights_only=True) reads them back. A resumed rank
takes the states of the sub-streams it owns (owned_states), at any world size that divides S.
bench_stream.py --sections checkpoint (8 packed sub-streams, 128 rows open each, 2 ranks): 1.98 /
4.02 / 8.22 MB in the checkpoint at --seq-len 512 / 1024 / 2048, each rank sending half, gathered
in 7 / 11 / 17 ms (gloo ranks as threads of one process, on a shared 2-core machine).

How the scripts use it: config.validate calls check_flags; dataset.Corpus (run_data.prepare)
calls sub_streams and, on a resume, check_resume before anything is written; before each save
every rank calls StreamedDataset.gather (gather_states, a collective), and rank 0's
checkpoint.run_state saves {"record": record(...), "states": ...}; a resumed rank loads
owned_states of them into its feed.
"""

import re
import sys
from pathlib import Path

import torch.distributed as dist
from tokenizers import Tokenizer

import data
from training import corpus, launch
from training.errors import UsageError
from training.stream import order, shards
from training.stream.holdout import HeldOut
from training.stream.hub import Pin
from training.stream.order import LIMIT

DEFAULT_SUB_STREAMS = 8  # the GPUs of a node: a run resumes at 1, 2, 4 or 8 ranks
# The record's fields, in the order check_resume compares them: the data first, then the flags
# that decide its rows (a changed corpus explains everything after it).
FIELDS = ("hub", "shards", "text_column", "held_out", "sub_streams", "seq_len", "seed", "pack", "tokenizer")


def check_flags(cfg) -> None:
    """--stream and --sub-streams where they can work, before anything is read (config.validate
    calls it): one line for each flag given where it makes no sense."""
    if cfg.sub_streams is not None and not cfg.stream:
        raise UsageError("--sub-streams sets how many sub-streams --stream deals the shards into: add --stream, or "
                         "leave it out")
    if not cfg.stream:
        return
    if cfg.max_steps is None:  # --model's preset gives a stream none (config.parse_args)
        raise UsageError("--stream needs --max-steps (the run's length and its learning rate schedule's): a stream's "
                         "steps are not known before its shards are read, and --model's preset gives a stream none")
    if cfg.max_steps * cfg.batch_size > sys.maxsize:  # the stream's len() (dataset.py), refused later by Python
        raise UsageError(f"--max-steps {cfg.max_steps:,} x --batch-size {cfg.batch_size:,} sequences are more than a "
                         f"run can count ({sys.maxsize:,}): lower one of them")
    if cfg.epochs is not None:
        raise UsageError("--epochs counts passes over a corpus tokenized before the run; --stream reads its shards "
                         "epoch after epoch until --max-steps: leave --epochs out")
    if cfg.sub_streams is not None and cfg.batch_size % cfg.sub_streams:
        raise UsageError(f"--sub-streams {cfg.sub_streams} does not divide --batch-size {cfg.batch_size}: each step "
                         "takes as many rows from every sub-stream")
    if cfg.dataset == corpus.EMBEDDED_CORPUS:
        raise UsageError(f"--stream reads a folder or file of shards ({shards.KNOWN_SHARDS}) or a Hub dataset's, and "
                         f"the embedded corpus ({corpus.EMBEDDED_CORPUS}) is none: give --dataset, or leave --stream "
                         "out")
    if not corpus.looks_local(cfg.dataset):  # a Hub id: its files are listed, and checked, by hub.py
        return
    if not Path(cfg.dataset).expanduser().is_dir() and shards.shard_kind(cfg.dataset) is None:
        raise UsageError(f"--stream reads {shards.KNOWN_SHARDS} shards, not {cfg.dataset}: convert it, or leave "
                         "--stream out")


def sub_streams(cfg, world_size: int, piece_sizes: list[int], recorded: dict | None = None) -> int:
    """The run's sub-stream count S: --sub-streams; on a resume without it, the recorded run's;
    else the default (the module's docstring) for this world size and these pieces (their sizes
    as order.deal sees them: HeldOut.training_sizes). Called after config.micro_batch_size (the
    world size divides --batch-size). A world size that does not divide S is one line naming
    those that do (order.owned); more sub-streams than pieces with data, one line (order.deal)."""
    if recorded is not None and cfg.sub_streams is None:
        streams = checked_record(recorded)["sub_streams"]
    elif cfg.sub_streams is not None:
        streams = cfg.sub_streams
    else:
        holding = sum(size > 0 for size in piece_sizes)
        most = min(max(DEFAULT_SUB_STREAMS, world_size), holding)
        fitting = [s for s in range(world_size, most + 1, world_size) if cfg.batch_size % s == 0]
        if not fitting:  # fewer pieces than ranks: S would leave a rank without data
            raise UsageError(f"the corpus has {holding} pieces that hold training data (a parquet row group or a "
                             f".jsonl file each), fewer than the {world_size} {launch.data_parallel_units(cfg.tp)}: "
                             "each reads whole pieces. Split its files, or train on fewer ranks")
        streams = fitting[-1]
    order.owned(streams, world_size, 0, launch.data_parallel_units(cfg.tp))  # a world size not dividing S: one line
    return streams


def record(cfg, found_shards: list[shards.Shard], held_out: HeldOut, streams: int, tokenizer: Tokenizer,
           pin: Pin | None = None) -> dict:
    """What the run reads, for its checkpoints: the Hub dataset's pin where the shards are its
    files, the shards, the held-out set and what decides the rows (the module's docstring).
    Ints, strs, bools, lists, dicts and nulls."""
    return {"hub": pin.to_dict() if pin is not None else None, "shards": [shard.to_dict() for shard in found_shards],
            "text_column": cfg.text_column, "held_out": held_out.to_dict(), "sub_streams": streams,
            "seq_len": cfg.seq_len, "seed": cfg.seed, "pack": cfg.pack,
            "tokenizer": data.tokenizer_fingerprint(tokenizer)}


def _count(least: int):
    return lambda n: type(n) is int and least <= n < LIMIT  # type(): a bool is no count


# Each field's kind, checked before any comparison; the pin, the shards and the held-out set are
# then checked whole by their own classes (Pin.from_dict, shards.changed, HeldOut.from_dict)
KINDS = {"hub": (lambda v: v is None or isinstance(v, dict), "a Hub dataset's pin or null"),
         "shards": (lambda v: isinstance(v, list), "a list of shards"),
         "text_column": (lambda v: isinstance(v, str) and bool(v), "a column's name"),
         "held_out": (lambda v: isinstance(v, dict), "a held-out set"),
         "sub_streams": (_count(1), "a whole number of at least 1"),
         "seq_len": (_count(1), "a whole number of at least 1"),
         "pack": (lambda v: type(v) is bool, "true or false"),
         "seed": (_count(0), "a whole number from 0 to 2**63 - 1"),
         "tokenizer": (lambda v: isinstance(v, str) and re.fullmatch("[0-9a-f]{32}", v), "a tokenizer's fingerprint")}


def checked_record(recorded, source: str = "the checkpoint") -> dict:
    """A record as a checkpoint holds it, each field of the kind record() writes: one line
    naming the field otherwise (the checkpoint may be hostile, or of another version)."""
    where = f"{source}'s stream record"
    if not isinstance(recorded, dict) or set(recorded) != set(FIELDS):
        found = sorted(map(str, recorded)) if isinstance(recorded, dict) else type(recorded).__name__
        raise UsageError(f"{where} holds {found}, not {', '.join(FIELDS)}: it is damaged, or of another version of "
                         "this trainer")
    for field, (holds, kind) in KINDS.items():
        if not holds(recorded[field]):
            shown = " ".join(repr(recorded[field]).split())[:60]
            raise UsageError(f"{where}: {field} is {shown}, not {kind}")
    return recorded


def check_resume(recorded: dict | None, now: dict | None, source: str = "the checkpoint") -> None:
    """A resumed run reads what the checkpoint's run read: one UsageError line naming the first
    thing that differs between the record the checkpoint holds and this run's (record()), or
    anything wrong in the one it holds; nothing is written before (the caller's order). A Hub
    dataset's pin is compared where both runs read one (a resume of the same dataset reads its
    recorded commit: hub.hub_source); a run that read a Hub dataset's files may resume from a
    local copy of them, and the other way round, where the shards are the same. None:
    a run without --stream; resuming one with it, or the other way round, is one line too.
    source: the checkpoint, as the line names it."""
    if recorded is None or now is None:
        if (recorded is None) != (now is None):
            was = "without" if recorded is None else "with"
            raise UsageError(f"{source} was trained {was} --stream: resume {was} it (its data position counts "
                             f"{'rows of a stream' if recorded is not None else 'rows of the tokenized corpus'})")
        return
    was = checked_record(recorded, source)
    pins = [Pin.from_dict(pin) if pin is not None else None for pin in (was["hub"], now["hub"])]
    if None not in pins and pins[0] != pins[1]:  # a Hub dataset's files, or local ones: their shards compared
        pin = pins[0]
        flags = f"--dataset {pin.dataset}{f' --dataset-config {pin.config}' if pin.config is not None else ''} " \
                f"--split {pin.split}"
        raise UsageError(f"{source} read {pin}, and this run reads {pins[1]}: resume with {flags}")
    what = shards.changed(was["shards"], [shards.Shard.from_dict(d) for d in now["shards"]])
    if what:
        raise UsageError(f"{source} was trained on other shards: {what}. Resume with the shards it read, or start "
                         "a new run")
    if was["text_column"] != now["text_column"]:
        raise UsageError(f"{source} read the column {was['text_column']!r} of its shards, and this run reads "
                         f"{now['text_column']!r}: resume with --text-column {was['text_column']}")
    HeldOut(**now["held_out"]).check(was["held_out"])  # one line: its count, or where it ends
    if was["sub_streams"] != now["sub_streams"]:
        raise UsageError(f"{source} dealt its shards into {was['sub_streams']} sub-streams, and this run into "
                         f"{now['sub_streams']}: resume with --sub-streams {was['sub_streams']}, or leave it out")
    for field in ("seq_len", "seed"):
        if was[field] != now[field]:
            flag = "--" + field.replace("_", "-")
            raise UsageError(f"{source} read its rows with {flag} {was[field]}, and this run asks for {now[field]}: "
                             f"resume with {flag} {was[field]}")
    if was["pack"] != now["pack"]:
        said = "with" if was["pack"] else "without"
        raise UsageError(f"{source} was trained {said} --pack (its rows hold "
                         f"{'several windows' if was['pack'] else 'one window'} each): resume {said} --pack")
    if was["tokenizer"] != now["tokenizer"]:
        raise UsageError(f"{source} read its rows with another tokenizer (its ids stand for other tokens): resume "
                         "with the run's own tokenizer.json")


def check_same_mode(ckpt: dict, streaming: bool) -> None:
    """A checkpoint of a streamed run resumes with --stream, one of a map-style run without it:
    one line otherwise (check_resume's), before any data is read."""
    if (ckpt.get("stream") is None) == streaming:
        check_resume(ckpt.get("stream"), {} if streaming else None, ckpt["path"])


def gather_states(feed, group=None) -> dict[int, dict] | None:
    """Every rank's sub-stream states (feed.state_dict(): a StreamFeed's, or ReadAhead's, those
    of the steps handed to the loop), all S keyed by sub-stream, on rank 0 of `group` (the
    trainers' gloo control group; None: the default group); None on the other ranks. A
    collective: every rank calls it. One process (no process group): its own, all S."""
    states = feed.state_dict()
    if group is None and not dist.is_initialized():
        return dict(sorted(states.items()))
    rank, size = (group.rank(), group.size()) if group is not None else (dist.get_rank(), dist.get_world_size())
    gathered = [None] * size
    dist.all_gather_object(gathered, states, group=group)
    if rank != 0:
        return None
    # under TP (train_tp.py) each TP group's ranks read the same sub-streams: one of each is kept
    states = {stream: state for part in gathered for stream, state in part.items()}
    return dict(sorted(states.items()))


def owned_states(all_states, streams: int, world_size: int, rank: int, source: str = "the checkpoint") -> dict:
    """The states rank `rank` of `world_size` loads (StreamFeed.load_state_dict) of those a
    checkpoint holds: the sub-streams it owns (order.owned: a world size that does not divide S
    is one line naming those that do). The checkpoint must hold every one of the run's S, keyed
    by its number, and no other: one line otherwise (each state is checked as its feed loads it)."""
    owned = order.owned(streams, world_size, rank)
    where = f"{source}'s sub-stream states"
    if not isinstance(all_states, dict):
        raise UsageError(f"{where} are a {type(all_states).__name__}, not a dict of sub-stream to state")
    if any(type(stream) is not int for stream in all_states):  # type(): a bool is no sub-stream
        bad = next(stream for stream in all_states if type(stream) is not int)
        raise UsageError(f"{where} name a sub-stream {bad!r}, not a sub-stream's number")
    missing = [stream for stream in range(streams) if stream not in all_states]
    others = sorted(stream for stream in all_states if not 0 <= stream < streams)
    if missing or others:
        problem = f"lack sub-streams {missing}" if missing else f"hold sub-streams {others}"
        raise UsageError(f"{where} {problem}, and the run has {streams} (0 to {streams - 1}): the checkpoint is "
                         "damaged; move it away to resume from the one before it")
    return {stream: all_states[stream] for stream in owned}
