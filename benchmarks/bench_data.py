"""Measure data preparation: how fast a corpus becomes training sequences, next to the
tokenizer's own speed on the same text.

    python bench_data.py                       # a generated 200 MB FineWeb-shaped parquet
    python bench_data.py --data my.parquet     # your own file (a `text` column)
    python bench_data.py --launch              # also time train_dp.py from launch to its first step

The generated corpus has FineWeb's columns (text, id, dump, url, date, file_path, language,
language_score, token_count) and its shape: documents of log-normal length (median about
1,800 characters, a long tail past 50,000), English-like words with Zipf frequencies,
sentences and paragraphs. It is written once and reused (--data-dir).

Two rows, each on a fresh `datasets` cache, with the same tokenizer (a BPE trained once on a
sample, not timed), over the same full texts:
  raw encode_batch   tokenizer.encode_batch over every whole document, on every core: the
                     ceiling for tokenizing them
  ours               run_data.Corpus + its training_rows, as the trainers call them:
                     load, split, encode every document whole and cut it into windows
MB/s counts the UTF-8 bytes of the documents' text.

Then the loader: rows a second through the DataLoader as the trainers build it (shuffled,
--batch-size rows a batch, in the training process), reading ours's tokenized cache a batch
at a time (data.PaddedSequenceDataset.__getitems__), and as it was, a row at a time from
Python lists, beside what one H100 trains.
"""

import argparse
import atexit
import math
import os
import random
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root, from any folder

H100_TOKENS_PER_S = 470_936  # bench.py on one H100: the article model, 64 x 512, bf16, compiled
FINEWEB_COLUMNS = ("text", "id", "dump", "url", "date", "file_path", "language", "language_score", "token_count")


def parse_args(argv=None):
    from training.errors import ArgumentParser, at_least
    p = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_corpus_arguments(p, megabytes=200)
    p.add_argument("--seq-len", type=at_least(1), default=512, help="tokens per sequence (the article preset's)")
    p.add_argument("--batch-size", type=at_least(1), default=64, help="rows a batch for the loader (the article preset's)")
    p.add_argument("--launch", action="store_true", help="also time train_dp.py from launch to its first step")
    args = p.parse_args(argv)
    check_data(args)
    return args


MIN_VOCAB = 256 + 3  # every byte, and the special tokens (the trainers' own bound)


def add_corpus_arguments(p, megabytes: int):
    """The flags of every benchmark that reads this corpus (or --data) and its BPE; check_data
    checks them."""
    from training.errors import at_least, path_argument
    p.add_argument("--data", type=path_argument, help="a parquet file with a `text` column (default: generate one)")
    p.add_argument("--mb", type=at_least(1), default=megabytes, help="MB of text to generate")
    p.add_argument("--data-dir", type=path_argument, default=os.path.join(tempfile.gettempdir(), "bench_data"),
                   help="where the generated corpus is kept between runs")
    p.add_argument("--vocab-size", type=at_least(MIN_VOCAB), default=50000, help="BPE size (the article preset's)")


def corpus_path(args) -> Path:
    """The corpus a run reads: --data, or the one generated in --data-dir."""
    return Path(args.data) if args.data else Path(args.data_dir) / f"fineweb_like_{args.mb}mb.parquet"


def check_data(args):
    """Before anything is generated or trained: --data, or a generated corpus already in
    --data-dir, must be a parquet file with a `text` column (its footer is read, not its rows);
    the corpus's folder, where a corpus or its BPE is still to be written, a folder this
    process may write in (one that holds both may be read-only)."""
    from training import run_folder
    from training.errors import UsageError
    path = corpus_path(args)
    if args.data is not None and not os.path.lexists(path):
        raise UsageError(f"--data {path}: no such file (a parquet file with a `text` column)")
    if not (os.path.lexists(path) and bpe_path(path, args.vocab_size).exists()):  # something to write there
        run_folder.check_writable(str(path.parent), "--data" if args.data is not None else "--data-dir")
    if args.data is not None:
        check_parquet(path, "--data")
    elif os.path.lexists(path):
        try:
            check_parquet(path, "the corpus generated earlier")
        except UsageError as e:
            raise UsageError(f"{e}: remove it, and the next run generates it anew") from None


def check_parquet(path: Path, what: str):
    """A parquet file that holds a `text` column; anything else (a text file, a torn parquet, a
    FIFO) is one line."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    from training import corpus
    from training.errors import UsageError, first_line
    corpus.regular_file(path, what)  # a FIFO would block the read
    try:
        names = pq.read_schema(path).names
    except (pa.ArrowException, OSError) as e:
        raise UsageError(f"{what} {path} is not a parquet file, or not a whole one: {first_line(e)}") from None
    if "text" not in names:
        raise UsageError(f"{what} {path} has no `text` column (its columns: {', '.join(names)})")


def read_texts(path: Path) -> list[str]:
    """The corpus's documents with any text (check_parquet read its footer first); rows
    that cannot be read are one line."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    from training.errors import UsageError, first_line
    try:
        texts = pq.read_table(path, columns=["text"]).column("text").to_pylist()
    except (pa.ArrowException, OSError) as e:
        raise UsageError(f"cannot read the texts of {path}: {first_line(e)}") from None
    return [t for t in texts if t and t.strip()]


# ---- a FineWeb-shaped corpus ------------------------------------------------------------------

def word_frequencies():
    """Words and their counts, from the Python standard library's text (on every machine)."""
    from training import corpus
    counts = {}
    for doc in corpus.stdlib_documents(corpus.stdlib_files()[:400]):
        for word in re.findall(r"[a-z]{2,12}", doc["text"].lower()):
            counts[word] = counts.get(word, 0) + 1
    words = sorted(counts, key=counts.get, reverse=True)[:20000]
    return words, [1.0 / (rank + 1) for rank in range(len(words))]  # Zipf


def generate(path: Path, megabytes: int):
    """Write the corpus to path whole or not at all (files.atomic_write): a full disk leaves no
    torn file there for every later run to read, and says so in one line."""
    from training import files
    files.atomic_write(path, lambda f: write_corpus(f, megabytes), megabytes * 1_000_000)


def write_corpus(f, megabytes: int):
    import pyarrow as pa
    import pyarrow.parquet as pq
    rng = random.Random(0)
    words, weights = word_frequencies()
    cum = list(__import__("itertools").accumulate(weights))
    rows, total, writer, doc_id = [], 0, None, 0
    while total < megabytes * 1_000_000:
        length = min(100_000, max(200, int(rng.lognormvariate(math.log(1800), 1.0))))
        pool = rng.choices(words, cum_weights=cum, k=length // 5)
        paragraphs, i = [], 0
        while i < len(pool):
            sentences = []
            for _ in range(rng.randint(2, 6)):
                n = rng.randint(5, 25)
                sentence = " ".join(pool[i:i + n])
                i += n
                if sentence:
                    sentences.append(sentence[0].upper() + sentence[1:] + rng.choice(".....?!"))
            paragraphs.append(" ".join(sentences))
        text = "\n\n".join(p for p in paragraphs if p)[:length]
        rows.append({"text": text, "id": f"<urn:uuid:{rng.getrandbits(128):032x}>", "dump": "CC-MAIN-2024-10",
                     "url": f"https://example.org/{doc_id}/{pool[0]}", "date": "2024-02-21T06:00:00Z",
                     "file_path": f"s3://commoncrawl/crawl-data/CC-MAIN-2024-10/{doc_id % 1000:05d}.warc.gz",
                     "language": "en", "language_score": 0.9 + rng.random() / 10, "token_count": len(text) // 4})
        total += len(text.encode())
        doc_id += 1
        if len(rows) == 10_000:
            table = pa.Table.from_pylist(rows)
            writer = writer or pq.ParquetWriter(f, table.schema)
            writer.write_table(table)
            rows = []
    if rows:
        table = pa.Table.from_pylist(rows)
        writer = writer or pq.ParquetWriter(f, table.schema)
        writer.write_table(table)
    writer.close()


def prepared_corpus(args) -> Path:
    """--data, or the generated corpus, written first if it is not there yet."""
    path = corpus_path(args)
    if not path.exists():
        print(f"writing {path} ...", flush=True)
        path.parent.mkdir(parents=True, exist_ok=True)
        generate(path, args.mb)
    return path


def bpe_path(path: Path, vocab_size: int) -> Path:
    return path.with_name(f"{path.stem}.bpe{vocab_size}.json")


def bpe(path: Path, vocab_size: int, texts: list[str] | None = None) -> Path:
    """The corpus's BPE of vocab_size tokens, kept beside it: trained once, on its first 20,000
    documents (not timed), and written whole."""
    tokenizer_path = bpe_path(path, vocab_size)
    if not tokenizer_path.exists():
        import datasets
        import data
        from training import files
        sample = datasets.Dataset.from_dict({"text": (read_texts(path) if texts is None else texts)[:20_000]})
        files.atomic_save(data.train_tokenizer(sample, vocab_size).to_str(), tokenizer_path)
    return tokenizer_path


# ---- the rows -------------------------------------------------------------------------------

_CACHES = []  # fresh_cache's folders, removed as the process ends (remove_caches)


def fresh_cache():
    """A `datasets` cache of its own for each row, so no row reads another's results. Removed
    when the process ends at the latest: its tokenized rows may be read until then (gpu_report.py
    times batches of them), and a benchmark run in a test's process or a report's left one
    behind in the temporary folder each time."""
    import datasets
    folder = tempfile.mkdtemp(prefix="bench_data_cache_")
    if not _CACHES:
        atexit.register(remove_caches)
    _CACHES.append(folder)
    datasets.config.HF_DATASETS_CACHE = Path(folder)
    return folder


def remove_caches():
    """Every folder fresh_cache made, removed: at exit, or by a process that leaves with
    os._exit (gpu_report.py's workers), which runs no exit handler."""
    while _CACHES:
        shutil.rmtree(_CACHES.pop(), ignore_errors=True)


def raw_encode_batch(texts, tokenizer):
    """The tokenizer alone: encode_batch over every whole document, with its own threads."""
    start = time.perf_counter()
    for i in range(0, len(texts), 1000):
        tokenizer.encode_batch(texts[i:i + 1000], add_special_tokens=False)
    return time.perf_counter() - start


def ours(cfg, tokenizer, made: dict):
    """What the three scripts run, given --tokenizer (the training set is kept in made)."""
    from training import run_data
    start = time.perf_counter()
    made["train"] = run_data.Corpus(cfg).training_rows(tokenizer)
    return time.perf_counter() - start


def one_row_at_a_time(ds):
    """The reader as it was: each row a Python list of ints, padded into a tensor, row by row."""
    import torch

    class OneRowAtATime(torch.utils.data.Dataset):
        def __len__(self):
            return len(ds)

        def __getitem__(self, i):
            ids = torch.tensor(ds.rows[i]["input_ids"], dtype=torch.long)
            x = torch.full((ds.seq_len,), ds.pad_id, dtype=torch.long)
            y = torch.full((ds.seq_len,), -100, dtype=torch.long)
            x[:len(ids) - 1], y[:len(ids) - 1] = ids[:-1], ids[1:]
            return x, y
    return OneRowAtATime()


def loader_rows_per_s(dataset, batch_size: int, seconds: float = 10.0) -> float:
    """Rows a second through the DataLoader as the trainers build it (the shuffling sampler,
    in the training process), for about `seconds`."""
    import torch
    import data
    sampler = data.ResumableDistributedSampler(dataset, num_replicas=1, rank=0, shuffle=True, seed=0, drop_last=True)
    rows, start = 0, time.perf_counter()
    for batch in torch.utils.data.DataLoader(dataset, batch_size=batch_size, sampler=sampler, drop_last=True):
        rows += len(batch[0])  # (x, y), or (x, y, position_ids) for packed rows
        if time.perf_counter() - start > seconds:
            break
    return rows / (time.perf_counter() - start)


def launch_to_first_step(path, out_dir, extra=()):
    """Seconds from `python train_dp.py` to the start of its first optimizer step (the line
    it prints as the training loop begins), on a cold `datasets` cache. The run is stopped
    there: what follows is training, not preparation."""
    env = {**os.environ, "HF_HOME": tempfile.mkdtemp(prefix="bench_data_hf_")}
    cmd = [sys.executable, "train_dp.py", "--dataset", str(path), "--out-dir", out_dir, *extra]
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=Path(__file__).resolve().parents[1], env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                            text=True)
    for line in proc.stdout:
        if "parameters |" in line:
            seconds = time.perf_counter() - start
            proc.kill()
            proc.wait()
            return seconds
    raise SystemExit(f"{' '.join(cmd)} exited with {proc.wait()} before training")


def main():
    args = parse_args()
    os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")
    import datasets
    from training import config, launch, tokenized
    datasets.logging.set_verbosity_error()

    path = prepared_corpus(args)
    texts = read_texts(path)
    megabytes = sum(len(t.encode()) for t in texts) / 1e6
    cores = launch.usable_cores()
    print(f"{path.name}: {len(texts):,} documents, {megabytes:.0f} MB of text | {cores} cores | "
          f"--seq-len {args.seq_len} | BPE of {args.vocab_size:,} tokens", flush=True)

    tokenizer_path = bpe(path, args.vocab_size, texts)
    tokenizer = tokenized.load_tokenizer(tokenizer_path)
    cfg = config.parse_args(["--dataset", str(path), "--seq-len", str(args.seq_len), "--model", "article",
                               "--tokenizer", str(tokenizer_path)])

    rows, made = [], {}
    for name, fn in (("raw encode_batch (the tokenizer alone)", lambda: raw_encode_batch(texts, tokenizer)),
                     ("ours: run_data.Corpus + training_rows", lambda: ours(cfg, tokenizer, made))):
        cache = fresh_cache()
        seconds = fn()
        rows.append((name, seconds))
        print(f"  {name:<45}{seconds:8.1f} s {megabytes / seconds:8.2f} MB/s", flush=True)
        if "train" in made:  # the loader reads this tokenized cache: measured before it goes
            loader = {"before: a row at a time": loader_rows_per_s(one_row_at_a_time(made["train"]), args.batch_size),
                      "ours: a batch at a time": loader_rows_per_s(made.pop("train"), args.batch_size)}
        shutil.rmtree(cache, ignore_errors=True)
    raw, new = (seconds for _, seconds in rows)
    print(f"\nours vs raw encode_batch: {raw / new:.2f}x its throughput (target: 0.8x or more)")
    print(f"\nThe loader: batches of {args.batch_size} x {args.seq_len} from the tokenized cache, shuffled, in the "
          "training process")
    for how, rate in loader.items():
        print(f"  {how:<45}{rate:10,.0f} rows/s")
    h100 = H100_TOKENS_PER_S / args.seq_len
    print(f"one H100 trains about {h100:,.0f} rows of {args.seq_len} a second (the article model compiled in bf16, "
          f"{H100_TOKENS_PER_S:,} tokens/s: docs/benchmarks.md); ours reads {loader['ours: a batch at a time'] / h100:.0f}x "
          f"that, before {loader['before: a row at a time'] / h100:.1f}x")

    if args.launch:
        with tempfile.TemporaryDirectory() as out:
            seconds = launch_to_first_step(path, os.path.join(out, "run"), ["--model", "article"])
        print(f"\npython train_dp.py --model article --dataset {path.name} (cold cache: BPE training "
              f"included): {seconds:.1f} s from launch to the first step")


if __name__ == "__main__":
    from training import stopping
    stopping.exit_on_usage_error(main)  # bad flags: one line, exit status 2
