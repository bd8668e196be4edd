"""--stream's data where the scripts take a dataset: run_data.prepare opens the corpus (its
shards, the held-out documents, the sub-stream count) and, once the tokenizer is known, gives
the scripts a StreamedDataset in place of the map-style training dataset.

What the scripts ask of a training dataset, and what a stream answers:
- len(): a stream's length is not known before it is read, so a streamed run is --max-steps
  long (config refuses --stream without it), and to the loop it is one epoch of that many
  steps: len() is --max-steps global batches. The corpus's own epochs pass inside it, each
  sub-stream on its own (order.py), counted in the sub-streams' positions.
- facts, targets_before(): what the log and the speedometer report; on a resume the real
  targets trained so far are the sum of those every sub-stream has handed out (rows.py counts
  them in its state), exact at any world size.
- read_ahead(device, group): the rank's feed of micro-batches (loader.py), from the checkpoint's
  positions, which the feed checks as the dataset is made (before the run writes anything); the
  ranks agree over `group` before each step (a shard one rank cannot read ends every rank).
- gather() and `saved`: every rank's positions gathered to rank 0 over that group before a save
  (a collective), which checkpoint.run_state puts in the checkpoint beside the run's record (run.py).
"""

import datasets

from training import config, corpus, launch
from training.errors import UsageError
from training.stream import holdout, integrity, loader, run, shards
from training.stream.holdout import HeldOut
from training.stream.hub import HubSource, hub_source
from training.stream.order import LIMIT, SubStreams


class Corpus:
    """A streamed run's corpus before its tokenizer is known: its source (--dataset's folder or
    file, or a Hub dataset's files at a commit: the checkpoint's on a resume, hub.py), the
    shards (listed by rank 0 and sent to all, so that every rank deals the same pieces), the
    held-out documents (the corpus's first --val-docs, or the checkpoint's count on a resume
    without the flag), and the sub-stream count S (run.sub_streams). `saved` is the
    checkpoint's (record, states), checked for kind."""

    def __init__(self, cfg, ckpt: dict | None, turns):
        self.cfg, self.turns = cfg, turns
        world_size = launch.data_parallel(cfg)[1]  # the ranks that read sub-streams of their own
        self.saved = saved(ckpt)
        recorded = run.checked_record(self.saved[0]) if self.saved else None
        self.source = cfg.dataset if corpus.looks_local(cfg.dataset) else turns.from_rank0(
            lambda: hub_source(cfg.dataset, cfg.dataset_config, cfg.split, recorded["hub"] if recorded else None))
        listed = turns.from_rank0(lambda: [s.to_dict() for s in shards.find_shards(self.source, cfg.text_column)])
        self.shards = [shards.Shard.from_dict(d) for d in listed]
        if cfg.val_docs is None and recorded is not None:  # the run's own count: --val-docs was left out
            cfg.val_docs = recorded["held_out"]["count"]
        texts, held_out = turns.from_rank0(lambda: self._held_out(cfg.val_docs))
        # as the map-style path holds its own (at most 1000 by default: in memory, never cached on disk)
        self.val_text, self.held_out = datasets.Dataset.from_dict({"text": texts}), HeldOut(**held_out)
        cfg.val_docs = self.held_out.count  # the number it stands for, in the checkpoints' train_config
        self.sizes = self.held_out.training_sizes(shards.piece_sizes(self.shards))
        cfg.sub_streams = run.sub_streams(cfg, world_size, self.sizes, recorded)  # recorded in train_config too

    def _held_out(self, count: int | None) -> tuple[list[str], dict]:
        texts, held_out = holdout.validation_documents(self.source, self.shards, self.cfg.text_column, count)
        return texts, held_out.to_dict()

    def train_tokenizer(self):
        """A run without --tokenizer: a BPE of the training documents from the stream's start."""
        return holdout.train_stream_tokenizer(self.source, self.shards, self.cfg.text_column,
                                              self.cfg.vocab_size, self.held_out)

    def training_rows(self, tokenizer) -> "StreamedDataset":
        """The training data, once the tokenizer is known, read as training goes: a resume must
        read what its checkpoint read (run.check_resume: one line naming the first change,
        nothing written)."""
        pin = self.source.pin if isinstance(self.source, HubSource) else None
        record = run.record(self.cfg, self.shards, self.held_out, self.cfg.sub_streams, tokenizer, pin)
        if self.saved:
            self.turns.everywhere(lambda: run.check_resume(self.saved[0], record, "the checkpoint"))
        return self.turns.everywhere(lambda: StreamedDataset(self, tokenizer, record))


def saved(ckpt: dict | None) -> tuple[dict, dict] | None:
    """A checkpoint's stream entry as (record, states), or None where it has none (a new run).
    The entry is checked for kind here; the record by run.check_resume, the states by
    run.owned_states and the feed (the checkpoint may be hostile)."""
    if ckpt is None:
        return None
    entry = ckpt.get("stream")
    if entry is None:
        return None
    if not (isinstance(entry, dict) and set(entry) == {"record", "states"}):
        raise UsageError(f"{ckpt['path']}'s stream entry is not a record and its sub-streams' states: the checkpoint "
                         "is damaged; move it away to resume from the one before it")
    return entry["record"], entry["states"]


class StreamedDataset:
    """The training data of a --stream run, where the scripts take a dataset (the module's
    docstring says what each method stands for)."""

    corpus = packing_fingerprint = None  # the map-style path's records; a stream's is `record`

    def __init__(self, source: Corpus, tokenizer, record: dict):
        cfg = source.cfg
        self.cfg, self.tokenizer, self.record = cfg, tokenizer, record
        describe = shards.describe(source.source, source.shards)
        self.sub_streams = SubStreams(source.sizes, cfg.sub_streams, cfg.seed, describe)
        self.read = holdout.skip_held_out(shards.reader(source.source, source.shards, cfg.text_column), source.held_out)
        states = source.saved[1] if source.saved else None  # the checkpoint's, all S: each rank takes its own
        self._targets = 0
        if states is not None:
            run.owned_states(states, cfg.sub_streams, 1, 0)  # all S there, keyed by their numbers
            counts = [state.get("targets") if isinstance(state, dict) else None for state in states.values()]
            if not all(type(n) is int and 0 <= n < LIMIT for n in counts):
                raise UsageError("the checkpoint's sub-stream states do not count their targets as this trainer "
                                 "does: the checkpoint is damaged; move it away to resume from the one before it")
            self._targets = sum(counts)
        self.facts = {"shards": len(source.shards), "shard_bytes": sum(s.size for s in source.shards),
                      "pieces": len(source.sizes), "sub_streams": cfg.sub_streams, "held_out": source.held_out.count}
        self.hub = str(source.source) if isinstance(source.source, HubSource) else None  # the start-up line's
        self.saved = None  # gather()'s, for the checkpoint being saved
        # This rank's feed, made here, in run_data.prepare: a checkpoint's hostile or stale state
        # (a cursor past its piece, a window its document lacks) is one line before anything is
        # written, not once the run has rewritten its files and begun its loop.
        rank, world_size = launch.data_parallel(cfg)  # under TP, each TP group reads the same sub-streams
        self.feed = self._feed(rank, world_size)
        if states is not None:  # every piece the run read, checked as it is read again (integrity.py)
            known = integrity.known_pieces(states, len(source.sizes), describe)
            self.feed.load_state_dict(run.owned_states(states, cfg.sub_streams, world_size, rank), known)

    def __len__(self) -> int:
        return self.cfg.max_steps * self.cfg.batch_size

    def targets_before(self, step: int, batch_size: int, seed: int) -> int:
        return self._targets  # the checkpoint's step (0 for a new run): the only step a run starts at

    def _feed(self, rank: int, world_size: int) -> loader.StreamFeed:
        """Rank `rank`'s feed. Its workers: one a spare core of this rank's share, at most one a
        sub-stream it owns (a worker owns whole sub-streams), 0 where no core is spare: then
        ReadAhead's thread tokenizes (tokenizers releases the GIL)."""
        cfg = self.cfg
        owned = cfg.sub_streams // world_size
        spare = launch.usable_cores() // launch.ranks_on_this_node() - 1
        workers = max((n for n in range(owned + 1) if n == 0 or owned % n == 0 and n <= spare), default=0)
        return loader.StreamFeed(self.sub_streams, self.read, self.tokenizer, cfg.seq_len, cfg.pack, None,
                                 cfg.batch_size, world_size, rank, cfg.grad_accum, workers,
                                 specials=config.special_ids(cfg, self.tokenizer))

    def read_ahead(self, device, group=None) -> loader.AgreedSteps:
        """This rank's micro-batches, step after step (from the checkpoint's positions on a
        resume, at any world size that divides S), read one step ahead onto the device while
        the step before runs; the ranks agree before each step on the end and on a shard that
        one of them cannot read (loader.next_step, on `group`: the trainers' control group)."""
        self.feed.pin_memory = device.type == "cuda"
        return loader.AgreedSteps(loader.read_ahead(self.feed, device), group)

    def gather(self, batches: loader.AgreedSteps) -> None:
        """Every rank's sub-stream positions after the last step handed to the loop, to rank 0
        over the group read_ahead was given (a collective: every rank calls it before a save),
        for checkpoint.run_state."""
        states = run.gather_states(batches, batches.group)
        self.saved = {"record": self.record, "states": states} if states is not None else None
