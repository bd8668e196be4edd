"""The corpus in tokens, as a run gets them: its tokenizer read from a file and checked, and
every document cut into windows (data.py's framing) once: `datasets` caches the windows on
disk beside the corpus, and what the cache gives back is checked before it is used
(caches.py). data.py holds what a window is; this module, where a run's windows come from.
"""

import contextlib
import json
import os

import datasets
import pyarrow.compute
import tokenizers
from tokenizers import Tokenizer

import data
from training import caches, corpus
from training.errors import UsageError, first_line, warn
from training.launch import usable_cores

CACHED_WINDOWS = "the cached windows"  # what warnings and errors call the windows' cache files


def load_tokenizer(path: str, config=None) -> Tokenizer:
    """A tokenizer.json, checked: ids from 0 up without gaps, and, given the model's config (a
    model.LlamaConfig), one token an embedding row, and the special tokens there that the model
    frames documents with: ours, or an imported model's."""
    text = corpus.read_text(path, "tokenizer", 2**30)  # a regular file (of at most a GiB: 50,000 tokens take 4 MB)
    try:
        tokenizer = Tokenizer.from_str(text)
    except Exception as e:
        raise UsageError(f"cannot load tokenizer {path}: {first_line(e)}") from None
    # The model has one embedding row per token, ids 0 to size - 1: a larger id would fail
    # mid-training (an index out of range), and a huge one makes to_str() build a list that long.
    largest = max(tokenizer.get_vocab(with_added_tokens=True).values(), default=-1)
    if largest >= tokenizer.get_vocab_size():
        raise UsageError(f"tokenizer {path} has {tokenizer.get_vocab_size():,} tokens but ids up to {largest:,}: "
                         "a tokenizer whose ids have gaps is not supported (ids must run from 0 to its size - 1)")
    if config is not None and tokenizer.get_vocab_size() != config.vocab_size:  # its ids would index other rows
        raise UsageError(f"{path} has {tokenizer.get_vocab_size():,} tokens, and the model {config.vocab_size:,} "
                         "embedding rows (config.json): the tokenizer of another run or model?")
    if config is not None and config.own_special_tokens:  # an imported model's ids
        missing = [t for t in (config.bos_token_id, config.eos_token_id) if tokenizer.id_to_token(t) is None]
    else:
        missing = [t for t in data.SPECIAL_TOKENS if tokenizer.token_to_id(t) is None]
    if missing:
        raise UsageError(f"tokenizer {path} lacks the special tokens {', '.join(map(str, missing))}")
    model = json.loads(tokenizer.to_str())["model"]
    unknown = model.get("unk_token")
    if model["type"] in ("WordLevel", "WordPiece") and tokenizer.token_to_id(unknown or "") is None:
        # it would fail on the first word outside its vocabulary, mid-tokenization
        raise UsageError(f"tokenizer {path} is a {model['type']} tokenizer without its unknown token "
                         f"({unknown!r} is not in its vocabulary): it cannot encode words it has not seen")
    return tokenizer


def tokenize(texts: datasets.Dataset, tokenizer: Tokenizer, seq_len: int,
             specials: data.SpecialIds | None = None) -> datasets.Dataset:
    """Frame every document and cut it into windows of seq_len + 1 tokens (data.batch_windows),
    once: `datasets` caches the result on disk, under a key of everything that decides it (the
    documents, the tokenizer and its library's version, seq_len, data.py's encoding code and
    constants), and what the cache gives back is checked before it is used (caches.cached_map:
    each window 2 to seq_len + 1 tokens). Large corpora are split over one process per core,
    each encoding with one thread. specials: an imported model's framing, else ours."""
    specials = specials or data.special_ids(tokenizer)
    tokenizer = data.text_only(tokenizer)
    exact_cuts = data.clip_is_exact(tokenizer)
    if not exact_cuts and _longest(texts) > 2 * data.PIECE_CHARS:
        warn(f"documents longer than {2 * data.PIECE_CHARS:,} characters are encoded in pieces cut before "
             "whitespace, and this tokenizer (not a byte-level BPE) may encode a few characters at each cut "
             "differently from the whole text")
    num_proc = min(usable_cores(), len(texts) // 5000)
    # token ids in the narrowest type that holds them: 2 bytes each below 65,536 (8 as Python ints)
    ids = datasets.Value("uint16" if tokenizer.get_vocab_size() <= 2**16 else "uint32")
    key = datasets.fingerprint.Hasher.hash([texts._fingerprint, tokenizer.to_str(), tokenizers.__version__, seq_len,
                                            ENCODING_CODE, data.PIECE_CHARS, data.CUT.pattern, *specials[:2]])
    with tokenizer_threads(1 if num_proc > 1 else None):
        return caches.cached_map(
            texts, key, CACHED_WINDOWS, "tokenizing the corpus again",
            lambda windows: caches.wrong_windows(data.window_targets(windows), seq_len),
            function=data.batch_windows, batched=True, remove_columns=["text"],
            num_proc=num_proc if num_proc > 1 else None,
            fn_kwargs={"tokenizer": tokenizer, "seq_len": seq_len, "exact_cuts": exact_cuts, "specials": specials},
            features=datasets.Features({"input_ids": datasets.Sequence(ids)}), desc="tokenizing")


# The code that cuts documents into windows, in the windows' cache key: edited, it may cut otherwise
ENCODING_CODE = caches.code_hash(data.batch_windows, data.document_windows, data.pieces, data.clip_text)


def _longest(texts: datasets.Dataset) -> int:
    """The longest document's characters, from the Arrow column (no Python strings)."""
    lengths = pyarrow.compute.utf8_length(texts.with_format("arrow")[:]["text"])  # these documents only
    return pyarrow.compute.max(lengths).as_py() or 0


@contextlib.contextmanager
def tokenizer_threads(threads: int | None):
    """With one process per core, each process's tokenizer uses one thread. Setting
    TOKENIZERS_PARALLELISM before `datasets` forks the processes also keeps `tokenizers`
    from warning that it was forked after using its threads (to train the BPE)."""
    if threads is None:
        yield
        return
    before = os.environ.get("TOKENIZERS_PARALLELISM")
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    try:
        yield
    finally:
        if before is None:
            del os.environ["TOKENIZERS_PARALLELISM"]
        else:
            os.environ["TOKENIZERS_PARALLELISM"] = before
