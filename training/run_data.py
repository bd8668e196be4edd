"""A run's data, prepared in stages that the distributed scripts run in turns (turns.py):
the checkpoint to continue, then one pipeline, sources -> documents -> tokens -> windows ->
rows, for both ways a run reads its corpus. A Corpus holds the documents, training and held
out: this module's loads the whole corpus (map-style); training/stream/dataset.py's (--stream)
lists its shards and reads only their first documents. One tokenizer for the whole job is
trained on the training documents (or loaded). The held-out documents are cut into windows
and rows here (make_dataset), and so are the training ones, tokenized once and cached by
`datasets`, or with --stream as training goes. Nothing is written before every check has
passed: a refused run leaves no trace.
"""

from pathlib import Path

from tokenizers import Tokenizer

import data
from training import build, caches, config, corpus, packing, resume, run_folder, tokenized
from training.config import TrainConfig
from training.errors import UsageError, is_rank0, warn
from training.run_folder import TOKENIZER
from training.stream import dataset as stream_dataset
from training.stream import run as stream_run
from training.turns import OneProcess


def prepare(cfg: TrainConfig, turns=OneProcess(), sharded: bool = False, model_fits=None):
    """The checkpoint to resume from (None for a new run), the tokenizer, and the training and
    held-out datasets (with --stream, the training dataset is a StreamedDataset, read as training
    goes). sharded: the run's checkpoints are train_fsdp.py's. model_fits (a memory.Check):
    called with the vocabulary size, as soon as it is known."""
    resuming = turns.everywhere(lambda: resume.resuming(cfg.out_dir, cfg.resume))  # refuses to overwrite a run
    ckpt = turns.everywhere(lambda: resume.load_run(cfg.out_dir, sharded)) if resuming else None
    if ckpt is not None:  # a streamed run resumes streamed, a map-style one map-style: before any reading
        turns.everywhere(lambda: stream_run.check_same_mode(ckpt, cfg.stream))
    if cfg.init_from:  # the same weights on every rank: a Hub id each resolved to the commit rank 0 did
        rank0s = turns.from_rank0(lambda: cfg.init_from)
        turns.everywhere(lambda: same_init_from(cfg.init_from, rank0s))
    # sources -> documents: the training documents, and the held-out ones set apart
    documents = (stream_dataset.Corpus if cfg.stream else Corpus)(cfg, ckpt, turns)
    # documents -> tokens: one tokenizer for the whole job, which rank 0 trains (or loads) and sends to all
    tokenizer = Tokenizer.from_str(turns.from_rank0(
        lambda: get_tokenizer(cfg, documents.train_tokenizer, resuming).to_str()))
    if model_fits:  # a model too big for the device is refused before tokenizing, and before anything is written
        turns.everywhere(lambda: model_fits(tokenizer.get_vocab_size()))
    if cfg.init_from:  # so is a model that --init-from's weights do not fit
        turns.everywhere(lambda: build.check_init_from(cfg, tokenizer.get_vocab_size()))
    # tokens -> windows -> rows: the training documents' (a resume: the rows its checkpoint trained
    # on), and the held-out documents', which evaluation reads the same way on either path
    train_ds = documents.training_rows(tokenizer)
    val_ds = turns.local_rank0_first(lambda: make_dataset(cfg, tokenizer, documents.val_text, text_bytes=True))
    turns.everywhere(lambda: claim_out_dir(cfg, ckpt))  # only now: a refused run creates nothing
    return ckpt, tokenizer, train_ds, val_ds


class Corpus:
    """The documents of a map-style run: the whole corpus loaded (each node's local rank 0 first;
    the others then read `datasets`' cache) and split into training and held-out documents
    (load_text), and its fingerprint: a resumed run reads exactly the documents its checkpoint
    was trained on. Its training rows are tokenized once, cached beside the corpus."""

    def __init__(self, cfg: TrainConfig, ckpt: dict | None = None, turns=OneProcess()):
        self.cfg, self.ckpt, self.turns = cfg, ckpt, turns
        self.train_text, self.val_text, self.fingerprint = load_text(cfg, ckpt, turns)

    def train_tokenizer(self) -> Tokenizer:
        """A run without --tokenizer: a BPE of the training documents."""
        return data.train_tokenizer(self.train_text, self.cfg.vocab_size)

    def training_rows(self, tokenizer: Tokenizer):
        """Every training document's windows in rows (make_dataset), at least one step's worth;
        a resumed --pack run's the rows it trained on (check_same_packing)."""
        cfg = self.cfg
        train = self.turns.local_rank0_first(lambda: make_dataset(cfg, tokenizer, self.train_text,
                                                                  corpus=self.fingerprint))
        if len(train) < cfg.batch_size:  # not one step's worth
            raise UsageError(f"dataset has {len(train)} training rows of --seq-len {cfg.seq_len} (from "
                             f"{len(self.train_text)} documents), fewer than one --batch-size of {cfg.batch_size}")
        if self.ckpt is not None:
            self.turns.everywhere(lambda: check_same_packing(self.ckpt, cfg, train))
        return train


def same_init_from(mine: str, rank0s: str):
    """A Hub model's folder is .../snapshots/<commit>, under each node's own cache: the commit is what must agree."""
    def commit(path: str) -> str:
        return Path(path).name if Path(path).parent.name == "snapshots" else path
    if commit(mine) != commit(rank0s):
        raise UsageError(f"--init-from resolved to {mine} on this rank and to {rank0s} on rank 0 (a Hub model "
                         "updated while the job started?): start the job again")


def claim_out_dir(cfg: TrainConfig, ckpt: dict | None):
    """Rank 0 locks --out-dir for the whole run, then checks that nothing changed there while
    the data was prepared: no other run has saved into it since our first look."""
    if not is_rank0():
        return
    run_folder.lock_out_dir(cfg.out_dir)
    resume.resuming(cfg.out_dir, cfg.resume)  # a new run still finds no run there
    path = Path(ckpt["path"]) if ckpt else None
    if path and (not path.exists() or path.stat().st_ino != ckpt["inode"]):
        raise UsageError(f"{ckpt['path']} changed while this run prepared its data (another run saved "
                         "into the folder): start again")


def load_text(cfg: TrainConfig, ckpt: dict | None = None, turns=OneProcess()):
    """The corpus, split into training and held-out documents, and its fingerprint. Each
    node's local rank 0 loads it first (the others then read `datasets`' cache); rank 0 alone
    hashes it (about 3 s a GB) and sends the fingerprint to all. A resumed run must read
    exactly the documents its checkpoint was trained on."""
    documents = turns.local_rank0_first(
        lambda: corpus.load_corpus(cfg.dataset, cfg.dataset_config, cfg.split, cfg.text_column))
    fingerprint = turns.from_rank0(lambda: corpus.fingerprint(documents))
    return (*turns.everywhere(lambda: split_corpus(cfg, ckpt, documents, fingerprint)), fingerprint)


def split_corpus(cfg: TrainConfig, ckpt: dict | None, documents, fingerprint: dict):
    """Training and held-out documents, after checking that a resumed run reads its own."""
    if ckpt is not None:
        check_same_corpus(ckpt, fingerprint, cfg.dataset)
    # --val-docs as the number it stands for (its default depends on the corpus), in this run's
    # config and in the checkpoint's (None in one saved by a run that used the default), so that
    # a resume compares the documents held out, not how they were asked for
    cfg.val_docs = cfg.val_docs or corpus.default_val_docs(len(documents))
    if ckpt is not None:  # the same corpus (checked above): the same default
        ckpt["train_config"]["val_docs"] = ckpt["train_config"].get("val_docs") or corpus.default_val_docs(len(documents))
    return corpus.split_train_val(documents, cfg.val_docs, cfg.seed)


def check_same_corpus(ckpt: dict, fingerprint: dict, dataset: str):
    was = ckpt.get("corpus")
    if was is None:  # written before checkpoints recorded their data
        warn(f"{Path(ckpt['path']).name} does not record its data: cannot check that --dataset is unchanged")
    elif was != fingerprint:
        what = (f"{fingerprint['documents']} documents, was {was['documents']}"
                if fingerprint["documents"] != was["documents"]
                else f"the same number of documents ({was['documents']}), but their text or order differs")
        raise UsageError(f"--dataset {dataset} is not the data this run trained on ({what}): resume with "
                         "that data, or start a new run")


def check_same_packing(ckpt: dict, cfg: TrainConfig, train_ds):
    """A packed run resumes on the rows it trained on: its data position (a step, a row of the
    epoch's shuffle) means other windows in another packing. (Resumed with the other framing,
    resume.from_checkpoint says so.)"""
    if not cfg.pack or ckpt.get("framing") != data.PACKED_FRAMING:
        return
    was, name = ckpt.get("packing"), Path(ckpt["path"]).name
    if was is None:  # written before checkpoints recorded their packing
        warn(f"{name} does not record its packing: cannot check that --pack's rows are those it trained on")
    elif was != train_ds.packing_fingerprint:
        raise UsageError(f"--pack's rows (which windows each row holds) are not those {name} trained on: the packing "
                         "cached beside the windows changed since it was saved. Resume where that packing is (the "
                         "same `datasets` cache), or start a new run")


def get_tokenizer(cfg: TrainConfig, train_bpe, resuming: bool) -> Tokenizer:
    """The run's own tokenizer on resume, else --tokenizer, else train_bpe(): a BPE trained on
    the training documents."""
    if resuming:
        out = Path(cfg.out_dir)
        tokenizer = tokenized.load_tokenizer(out / TOKENIZER, config.imported(cfg))
        run_folder.check_tokenizer(out, tokenizer, run_folder.recorded_fingerprint(out))  # the run's own
        if cfg.tokenizer and tokenized.load_tokenizer(cfg.tokenizer, config.imported(cfg)).to_str() != tokenizer.to_str():
            raise UsageError(f"--tokenizer {cfg.tokenizer} differs from the run's {TOKENIZER}")
        return tokenizer
    if cfg.tokenizer:
        return tokenized.load_tokenizer(cfg.tokenizer, config.imported(cfg))
    return train_bpe()


def make_dataset(cfg: TrainConfig, tokenizer: Tokenizer, texts, text_bytes: bool = False, **facts):
    """Every document's windows, one a row, or with --pack several a row (held-out ones too, so
    that evaluation costs what training does). text_bytes: count their text's UTF-8 bytes, for
    bits per byte."""
    specials = config.special_ids(cfg, tokenizer)  # ours, or an imported model's own
    pad_id = specials.pad
    if text_bytes:
        facts["text_bytes"] = corpus.text_bytes(texts)
    windows = tokenized.tokenize(texts, tokenizer, cfg.seq_len, specials)
    # its cache files as this run opened them, checked before each batch is read
    read_back = caches.ReadBack(windows, tokenized.CACHED_WINDOWS)
    if cfg.pack:
        return packing.PackedSequenceDataset(windows, cfg.seq_len, pad_id, documents=len(texts), **facts,
                                             read_back=read_back, packing=packing.pack(windows, cfg.seq_len, cfg.seed))
    return data.PaddedSequenceDataset(windows, cfg.seq_len, pad_id, documents=len(texts), **facts, read_back=read_back)
