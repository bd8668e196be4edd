"""--pack: the windows of every document placed several to a row, each attending only to
itself with its positions from 0. A packed row computes what its windows compute alone,
so a packed run trains the model a padded one trains, with almost no compute on padding;
and everything that holds for padded runs holds packed (DP, DDP, FSDP, accumulation,
resume, evaluation, the memory estimate, compile, activation checkpointing)."""

import hashlib
import os
import re
import shutil
import stat

import datasets
import numpy as np
import pytest
import torch
import torch.nn.functional as F

import data
from conftest import (FAST, FAST_WITH_TOKENIZER, FLOOR_MULTIPLE, assert_learns, assert_same_model, assert_within,
                      load_weights, metrics, stopped_at_step_4, train)
from data import PaddedSequenceDataset
from model import IGNORE_INDEX, LlamaConfig, LlamaForPretraining, LlamaRotaryEmbedding
from test_bad_inputs import refused_in_process
from test_memory import saved_for_backward
from ops import packed_attention
from training import build, config, corpus, evaluation, memory, packing, run_data, tokenized
from training.errors import RankError, UsageError
from training.packing import PackedSequenceDataset

PACK = ["--pack"]


# ---- the packing ----------------------------------------------------------------------------

def one_item_at_a_time(sizes: np.ndarray, capacity: int, seed: int) -> list[list[int]]:
    """Best-fit decreasing as it is usually written, the plain formulation that
    packing.best_fit_decreasing computes in groups: each item, largest first (ties in the seed's
    shuffle), into the open bin with the least room that still holds it (of those, the one
    that came to that room first), else into a new bin."""
    shuffled = np.random.default_rng(seed).permutation(len(sizes))
    order = shuffled[np.argsort(-sizes[shuffled], kind="stable")]
    bins, room, since = [], [], []  # items, free positions, and when each bin came to its room
    for clock, item in enumerate(order.tolist()):
        fits = [b for b in range(len(bins)) if room[b] >= sizes[item]]
        if fits:
            b = min(fits, key=lambda b: (room[b], since[b]))
        else:
            b = len(bins)
            bins.append([]), room.append(capacity), since.append(0)
        bins[b].append(item)
        room[b] -= int(sizes[item])
        since[b] = clock
    return bins


@pytest.mark.parametrize("capacity", [16, 32, 100])
def test_the_packing_is_best_fit_decreasing_placed_one_window_at_a_time(capacity):
    rng = np.random.default_rng(capacity)
    sizes = np.concatenate([rng.integers(1, capacity + 1, 300), rng.integers(1, capacity // 4, 300),
                            np.full(20, capacity)])  # every size, many small ones, and full rows
    order, per_bin = packing.best_fit_decreasing(sizes, capacity, seed=5)
    bins = np.split(order, np.cumsum(per_bin)[:-1])
    assert [b.tolist() for b in bins] == one_item_at_a_time(sizes, capacity, seed=5)
    assert sorted(order.tolist()) == list(range(len(sizes)))  # each window once, whole
    assert max(sizes[b].sum() for b in bins) <= capacity
    # the same on every rank and every run with the seed; another seed arranges them otherwise
    again, _ = packing.best_fit_decreasing(sizes, capacity, seed=5)
    other, _ = packing.best_fit_decreasing(sizes, capacity, seed=6)
    assert np.array_equal(again, order) and not np.array_equal(other, order)


def fineweb_shaped_windows(seq_len: int, documents: int = 30_000) -> np.ndarray:
    """The positions each window of FineWeb-shaped documents fills (its targets): log-normal
    lengths, median 1,808 characters, about 4.3 characters a token, each document [BOT] + ids
    + [EOT] cut into windows of seq_len + 1 (all full but its last)."""
    chars = np.random.default_rng(0).lognormal(np.log(1808), 1.0, documents).clip(200, 100_000)
    targets = np.round(chars / 4.3).astype(np.int64) + 1
    full, last = np.divmod(targets, seq_len)
    return np.concatenate([np.full(full.sum(), seq_len), last[last > 0]])


@pytest.mark.parametrize("seq_len, padded_share", [(512, 0.28), (1024, 0.48)])
def test_packing_leaves_under_2_percent_padding_where_one_window_a_row_leaves_28_to_48(seq_len, padded_share):
    sizes = fineweb_shaped_windows(seq_len)
    assert 1 - sizes.sum() / (len(sizes) * seq_len) == pytest.approx(padded_share, abs=0.02)
    _, per_row = packing.best_fit_decreasing(sizes, seq_len, seed=1337)
    assert 1 - sizes.sum() / (len(per_row) * seq_len) < 0.02


def stored_windows(lengths, seed=0, vocab_size=60_000) -> datasets.Dataset:
    """Windows as tokenized.tokenize stores them (uint16), read through an index mapping."""
    rng = np.random.default_rng(seed)
    ids = [[1, *rng.integers(3, vocab_size, n - 2).tolist(), 2] for n in lengths]
    stored = datasets.Dataset.from_dict({"input_ids": ids}, features=datasets.Features(
        {"input_ids": datasets.Sequence(datasets.Value("uint16"))}))
    return stored.shuffle(seed=0).select(range(len(ids) - 5))


def test_a_packed_row_is_its_windows_as_each_reads_alone_one_after_another_then_padding():
    """Each window's inputs and targets as PaddedSequenceDataset gives them in a row of its own,
    its positions from 0; then padding, whose targets are ignored and whose positions start a
    window of their own. Every token of every window is a target once."""
    lengths = np.random.default_rng(1).integers(2, 18, 300).tolist() + [17] * 20  # up to seq_len + 1
    windows = stored_windows(lengths)
    padded = PaddedSequenceDataset(windows, seq_len=16, pad_id=0)
    packed = PackedSequenceDataset(windows, seq_len=16, pad_id=0, packing=packing.pack(windows, 16, seed=3))
    assert len(packed) < 0.7 * len(padded)
    rows = torch.utils.data.DataLoader(packed, batch_size=len(packed))  # read a batch at a time (__getitems__)
    (x, y, position_ids, cu_seqlens), = list(rows)
    placed = []
    for r in range(len(packed)):
        col = 0
        for w in packed.packing[r]["windows"]:
            wx, wy = padded[w]
            n = int((wy != IGNORE_INDEX).sum())
            assert torch.equal(x[r, col:col + n], wx[:n]) and torch.equal(y[r, col:col + n], wy[:n])
            assert torch.equal(position_ids[r, col:col + n], torch.arange(n))
            col, placed = col + n, placed + [w]
        assert (x[r, col:] == 0).all() and (y[r, col:] == IGNORE_INDEX).all()
        assert torch.equal(position_ids[r, col:], torch.arange(16 - col))
    assert sorted(placed) == list(range(len(windows)))
    assert torch.equal(cu_seqlens, bounds_from_positions(position_ids, packed.max_windows + 1))
    assert packed.targets.tolist() == (y != IGNORE_INDEX).sum(1).tolist()
    assert packed.facts["tokens_per_epoch"] == padded.facts["tokens_per_epoch"]
    assert packed.facts["rows"] == len(packed) and packed.facts["windows"] == len(windows)


def bounds_from_positions(position_ids, length: int) -> torch.Tensor:
    """The plain formulation of a row's cu_seqlens: a window starts wherever a position is 0
    (the padding's too), and the row ends at T; then T again, to `length` entries."""
    T = position_ids.shape[1]
    rows = [(row == 0).nonzero().flatten().tolist() + [T] for row in position_ids]
    return torch.tensor([bounds + [T] * (length - len(bounds)) for bounds in rows], dtype=torch.int32)


def test_each_rows_cu_seqlens_are_where_its_windows_end_at_one_length_for_the_whole_dataset():
    """varlen_attn's input, made by the loader: each row's bounds, 0, where each of its windows
    ends, then T repeated; as many for every row (one shape for every batch: no recompile).
    Every edge: a row of one window, a row of one-target windows, a row ending in padding, a
    window of one token; and the padding row evaluation adds, one window."""
    T = 16
    lengths = [T + 1, 11] + [2] * 16 + [7, 4]  # windows of T, 10, sixteen of 1, 6 and 3 targets
    windows = datasets.Dataset.from_dict({"input_ids": [[1, *[5] * (n - 2), 2] for n in lengths]},
                                         features=datasets.Features({"input_ids": datasets.Sequence(datasets.Value("uint16"))}))
    packed = PackedSequenceDataset(windows, seq_len=T, pad_id=0, packing=packing.pack(windows, T, seed=0))
    x, y, position_ids, cu_seqlens = torch.utils.data.default_collate(packed.__getitems__(list(range(len(packed)))))
    assert cu_seqlens.dtype == torch.int32 and cu_seqlens.shape == (len(packed), packed.max_windows + 1)
    assert torch.equal(cu_seqlens, bounds_from_positions(position_ids, packed.max_windows + 1))
    rows = [row[:row.tolist().index(T) + 1].tolist() for row in cu_seqlens]  # each row's bounds to its end
    assert [0, T] in rows  # the row of one window (no padding)
    assert any(row[-2] < T and (y[r, row[-2]:] == IGNORE_INDEX).all() for r, row in enumerate(rows))  # padding last
    assert any(np.diff(row).tolist().count(1) >= 6 for row in rows)  # windows of one target side by side
    assert max(len(row) - 1 for row in rows) <= packed.max_windows  # room for the fullest row and its padding
    # a batch of rows of one window each is as long: the length is the dataset's, not the batch's
    alone = [r for r, row in enumerate(rows) if len(row) == 2]
    assert [len(item[3]) for item in packed.__getitems__(alone)] == [packed.max_windows + 1] * len(alone)
    padding_row = packed.padding_row()[3]
    assert padding_row.tolist() == [0] + [T] * packed.max_windows


def test_the_batchs_windows_end_to_end_are_every_rows_shifted_by_the_rows_before():
    """What varlen_attn reads: the windows of the flattened (B x T) batch, each starting where
    a position is 0; a row's repeated ends become empty windows, which it skips."""
    _, (x, y, position_ids, cu_seqlens), _ = both_layouts()
    B, T = position_ids.shape
    windows = packed_attention.window_mask(position_ids, torch.float32, cu_seqlens)
    assert windows.max_len == T and windows.cu_seqlens.shape == (B * (cu_seqlens.shape[1] - 1) + 1,)
    starts = (position_ids.flatten() == 0).nonzero().flatten()
    assert torch.equal(torch.unique_consecutive(windows.cu_seqlens), torch.cat([starts, torch.tensor([B * T])]).int())


def test_packing_happens_once_and_is_read_back_from_the_cache(tmp_path):
    (tmp_path / "c.txt").write_text("\n".join(f"document {i} " + "word " * (i % 37) for i in range(200)) + "\n")
    texts = corpus.load_corpus(str(tmp_path / "c.txt"))
    tokenizer = data.train_tokenizer(texts, vocab_size=300)
    windows = tokenized.tokenize(texts, tokenizer, seq_len=16)
    first = packing.pack(windows, 16, seed=1)
    written = [os.stat(f["filename"]) for f in first.cache_files]
    second = packing.pack(windows, 16, seed=1)  # what the other ranks and later runs do
    assert first.cache_files and first.cache_files == second.cache_files
    assert [(st.st_ino, st.st_mtime_ns) for st in map(os.stat, (f["filename"] for f in second.cache_files))] == \
        [(st.st_ino, st.st_mtime_ns) for st in written]
    assert packing.pack(windows, 16, seed=2).cache_files != first.cache_files  # another seed: another packing


@pytest.fixture(scope="module")
def cached_windows(tmp_path_factory):
    """Windows tokenized into `datasets`' cache (their packing is cached beside them), and the
    rows this code packs them into at seq_len 16, seed 1."""
    path = tmp_path_factory.mktemp("packed") / "c.txt"
    path.write_text("\n".join(f"document {i} " + "word " * (i % 37) for i in range(200)) + "\n")
    texts = corpus.load_corpus(str(path))
    windows = tokenized.tokenize(texts, data.train_tokenizer(texts, vocab_size=300), seq_len=16)
    rows = packing.pack(windows, 16, seed=1)
    return windows, rows["windows"], rows.cache_files[0]["filename"]


def write_rows(rows: list[list[int]], path, numbers: str = "uint32"):
    """A well-formed packing cache file holding `rows` (window numbers of type `numbers`), in
    place of the one at path."""
    from datasets.arrow_writer import ArrowWriter
    features = datasets.Features({"windows": datasets.Sequence(datasets.Value(numbers))})
    with ArrowWriter(path=f"{path}.tmp", features=features) as writer:
        writer.write_batch({"windows": rows})
        writer.finalize()
    os.replace(f"{path}.tmp", path)


@pytest.mark.parametrize("damage, problem", [
    (lambda rows, path: write_rows([[0]] * len(rows), path), "places window 0 276 times (1 windows more than once)"),
    (lambda rows, path: write_rows([*rows, [0], [1]], path), "places window 0 2 times (2 windows more than once)"),
    (lambda rows, path: write_rows([rows[0][1:], *rows[1:]], path), "leaves out 1 of the 371 windows"),
    (lambda rows, path: write_rows([rows[0] + rows[1], *rows[2:]], path), "holds a row of 32 positions, more than --seq-len 16"),
    (lambda rows, path: write_rows([rows[0], [], *rows[1:]], path), "holds 1 empty rows"),
    (lambda rows, path: write_rows([[*rows[0], 9999], *rows[1:]], path), "places window 9,999, and the corpus has 371"),
    (lambda rows, path: write_rows([[*rows[0], -1], *rows[1:]], path, "int64"),
     "cannot be read (Integer value -1 not in range"),
    (lambda rows, path: open(path, "r+b").truncate(os.path.getsize(path) // 2), "cannot be read (Expected to be able to read"),
], ids=["every-row-window-0", "every-window-and-two-twice", "a-window-left-out", "a-row-over-seq-len",
        "an-empty-row", "a-window-that-does-not-exist", "a-negative-window", "truncated"])
def test_a_cached_packing_that_is_not_one_is_packed_again_with_a_warning_naming_it(cached_windows, capsys, damage,
                                                                                 problem):
    """The cache is a file: replaced, truncated or damaged, what it holds is never trained on.
    Every window exactly once (counted: a packing that holds every window, some of them twice,
    would train those twice an epoch), no row over seq_len, no empty row: anything else is
    packed again, from the windows, and said."""
    windows, rows, path = cached_windows
    damage(rows, path)
    assert packing.pack(windows, 16, seed=1)["windows"] == rows
    err = capsys.readouterr().err
    assert f"warning: --pack: the cached packing {path} {problem}" in err and "packing the windows again" in err
    assert packing.pack(windows, 16, seed=1)["windows"] == rows and not capsys.readouterr().err  # rewritten: good


@pytest.mark.timeout(60)  # without the check, the FIFO's read blocked forever (and SIGTERM, SIGINT with it)
@pytest.mark.parametrize("kind", ["fifo", "folder"])
def test_a_cached_packing_that_is_not_a_regular_file_is_one_line_and_left_as_it_is(cached_windows, kind):
    """A FIFO where the cache file belongs would block its read forever; a folder is someone's,
    and packing again would have to delete it to write there (it failed, a traceback after a
    warning). Either is refused in one line before anything reads it, and stays; removed, the
    windows are packed again."""
    windows, rows, path = cached_windows
    os.unlink(path)
    if kind == "fifo":
        os.mkfifo(path)
    else:
        os.mkdir(path)
        with open(os.path.join(path, "notes.txt"), "w") as f:
            f.write("mine")
    with pytest.raises(UsageError) as refused:
        packing.pack(windows, 16, seed=1)
    assert str(refused.value) == (f"--pack: the cached packing {path} is not a regular file (a FIFO, a device or a "
                                  "folder): replace it with the file it should be, or remove it")
    if kind == "fifo":
        assert stat.S_ISFIFO(os.stat(path).st_mode)
        os.unlink(path)
    else:
        assert os.listdir(path) == ["notes.txt"] and open(os.path.join(path, "notes.txt")).read() == "mine"
        shutil.rmtree(path)
    assert packing.pack(windows, 16, seed=1)["windows"] == rows and os.path.isfile(path)


@pytest.mark.parametrize("rows, problem", [
    ([[0, 1], [], [2]], "a row of 0 windows (each holds 1 to 2)"),
    ([[0, 1], [2, 99]], "a row places window 99 of 3"),
    ([[0, 1, 2]], "a row of 24 positions, more than --seq-len 16"),
], ids=["an-empty-row", "a-window-that-is-not-there", "a-row-over-seq-len"])
def test_a_packed_row_read_back_wrong_is_damaged_data_in_one_line(rows, problem):
    """What `pack` read back it checked; a row read wrong later (its file changed under the
    run) is damaged data, said by the rank that reads it, never an IndexError's traceback or a
    row over --seq-len."""
    windows = datasets.Dataset.from_dict({"input_ids": [[1, *range(3, 10), 2]] * 3})  # 8 positions each
    packed = PackedSequenceDataset(windows, seq_len=16, pad_id=0, packing=datasets.Dataset.from_dict({"windows": rows}))
    with pytest.raises(RankError) as damaged:
        packed.__getitems__(list(range(len(rows))))
    assert str(damaged.value) == (f"damaged data in --pack's cached packing (in memory): {problem}. Remove that cache "
                                  "(`datasets` makes it again) and run again with --resume")


def test_a_packing_written_while_a_run_reads_it_is_damaged_data_in_one_line(cached_windows):
    """The packing is memory-mapped: written in place under the run, what the next batch reads
    is no longer what was checked. Said in one line before that batch is read."""
    windows, _, path = cached_windows
    packed = PackedSequenceDataset(windows, seq_len=16, pad_id=0, packing=packing.pack(windows, 16, seed=1))
    packed.__getitems__([0, 1])
    size = os.path.getsize(path)
    with open(path, "ab") as f:  # a byte more, written in place
        f.write(b"\0")
    with pytest.raises(RankError) as damaged:
        packed.__getitems__([0, 1])
    assert str(damaged.value) == (f"damaged data in --pack's cached packing {path}: it changed while this run read "
                                  f"it ({size:,} bytes, now {size + 1:,}). Remove that cache (`datasets` makes it "
                                  "again) and run again with --resume")
    os.truncate(path, size)  # whole again, for the module's other tests


def test_the_packings_cache_key_is_everything_that_decides_the_rows(cached_windows, monkeypatch):
    """The windows, seq_len, the seed, and the packing code itself: edited, it packs otherwise,
    and the rows the code before it cached must not be taken for its own."""
    windows, _, path = cached_windows
    other = {"seq_len": packing.pack(windows, 17, seed=1), "seed": packing.pack(windows, 16, seed=2),
             "windows": packing.pack(windows.select(range(len(windows) - 1)), 16, seed=1)}
    monkeypatch.setattr(packing, "PACKING_CODE", "the code, edited")
    other["code"] = packing.pack(windows, 16, seed=1)
    files = {name: rows.cache_files[0]["filename"] for name, rows in other.items()}
    assert path not in files.values() and len(set(files.values())) == len(files)


def test_the_packing_code_is_hashed_by_its_source():
    import inspect
    source = inspect.getsource(packing._pack) + inspect.getsource(packing.best_fit_decreasing)
    assert packing.PACKING_CODE == hashlib.blake2b(source.encode(), digest_size=16).hexdigest()


# ---- the attention ----------------------------------------------------------------------------

def attention_inputs(T, B=3, H=4, K=2, D=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, n, T, D, generator=g, requires_grad=True) for n in (H, K, K))
    lengths = torch.randint(1, T, (B, T), generator=g)
    position_ids = torch.stack([torch.cat([torch.arange(n) for n in row.tolist()])[:T] for row in lengths])
    return q, k, v, position_ids


def attended(attend, q, k, v, position_ids, flip=False, backward=True) -> list[torch.Tensor]:
    """attend(q, k, v, position_ids)'s output and the gradients of its sum of squares; flip:
    computed on the batch in reverse order (the same sums, added in another order), put back."""
    y = attend(*(t.flip(0) for t in (q, k, v, position_ids))).flip(0) if flip else attend(q, k, v, position_ids)
    return [y.detach(), *(torch.autograd.grad((y * y).sum(), (q, k, v)) if backward else [])]


def in_one_call(q, k, v, position_ids):
    """The plain formulation: one scaled_dot_product_attention over every key, under the mask
    (made on the CPU, as a tensor: on CUDA window_mask makes flex attention's BlockMask)."""
    mask = packed_attention.window_mask(position_ids.cpu(), q.dtype).to(q.device)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)


def in_query_blocks(q, k, v, position_ids):
    return packed_attention.attention_in_query_blocks(q, k, v, packed_attention.window_mask(position_ids, q.dtype))


def with_flex(q, k, v, position_ids):
    return packed_attention.flex_attention(q, k, v, packed_attention.compiled_block_mask(position_ids))


def assert_far(what: str, distance: float, floor: float):
    """A mutant's distance: far beyond the bound the real code is held to (100 x FLOOR_MULTIPLE x the floor)."""
    print(f"{what} {distance:.2e} = {distance / floor:.0f}x the floor {floor:.2e}")
    assert distance > 100 * FLOOR_MULTIPLE * floor, f"{what} {distance:.3e} is within reach of the floor {floor:.3e}"


def relative_distance(a, b):
    return max(((x - y).abs().max() / y.abs().max()).item() for x, y in zip(a, b))


def test_queries_in_blocks_equal_one_call_with_the_whole_mask_forward_and_backward(monkeypatch):
    """What attention_in_query_blocks replaces: one call over every key. 600 positions: three
    blocks of queries, the last one short, each against the keys up to its own end (the same
    result as the whole mask at once, which scores every key: only the calls tell them apart).
    The floor: one call on the batch in reverse order."""
    inputs = attention_inputs(600)
    plain = attended(in_one_call, *inputs)
    floor = max(relative_distance(attended(in_one_call, *inputs, flip=True), plain), torch.finfo(torch.float32).eps)
    calls, sdpa = [], F.scaled_dot_product_attention

    def recorded(q, k, v, attn_mask, **kwargs):
        calls.append((q.shape[2], k.shape[2], tuple(attn_mask.shape[2:])))
        return sdpa(q, k, v, attn_mask=attn_mask, **kwargs)
    monkeypatch.setattr(packed_attention.F, "scaled_dot_product_attention", recorded)
    in_blocks = attended(in_query_blocks, *inputs)
    assert calls == [(256, 256, (256, 256)), (256, 512, (256, 512)), (88, 600, (88, 600))]  # queries, keys, mask
    assert_within("query blocks vs one call", relative_distance(in_blocks, plain), floor, FLOOR_MULTIPLE)


# Inductor compiles flex attention for a CPU only with its vector instructions: under
# ATEN_CPU_CAPABILITY=default, "torch.compile on current platform is not supported for CPU"
# (torch's flex_cpu.py). These two run CUDA's path on the CPU as a stand-in; CUDA's own tests are
# in test_cuda.py, and everything else compiled runs under default too.
compiles_flex_on_this_cpu = pytest.mark.skipif(torch.backends.cpu.get_cpu_capability() == "DEFAULT",
                                               reason="inductor compiles CPU flex attention with vector instructions only")


@pytest.mark.compile
@compiles_flex_on_this_cpu
def test_cudas_flex_attention_block_mask_computes_what_the_cpus_mask_computes():
    """CUDA's path (a BlockMask from the same positions, compiled flex attention), run here on
    the CPU, where flex attention computes forward only. Its backward: tests/test_cuda.py."""
    q, k, v, position_ids = attention_inputs(200)
    inputs = q.detach(), k.detach(), v.detach(), position_ids  # no backward on the CPU: none may require one
    with torch.no_grad():
        plain = attended(in_one_call, *inputs, backward=False)
        floor = max(relative_distance(attended(in_one_call, *inputs, flip=True, backward=False), plain),
                    torch.finfo(torch.float32).eps)
        flex = attended(with_flex, *inputs, backward=False)
    assert_within("flex attention vs one call", relative_distance(flex, plain), floor, FLOOR_MULTIPLE)


def random_layouts(n: int, B: int = 2, T: int = 256, seed: int = 0):
    """n batches of position_ids, each with its windows elsewhere: lengths from 1 to T."""
    g = torch.Generator().manual_seed(seed)
    for _ in range(n):
        lengths = torch.randint(1, T + 1, (B, T), generator=g)
        yield torch.stack([torch.cat([torch.arange(n) for n in row.tolist()])[:T] for row in lengths])


BLOCK_MASK_TENSORS = ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices", "q_num_blocks",
                      "q_indices", "full_q_num_blocks", "full_q_indices")


def test_the_block_mask_is_compiled_once_for_every_layout_and_equals_the_eager_one(monkeypatch):
    """CUDA's BlockMask comes from a compiled function of position_ids (7.62 ms eager, 0.21 ms
    compiled on an H100): one graph for 20 batches whose windows fall elsewhere (a closure over
    each batch's windows, made outside, would be a new input and a recompile each time), equal
    to the eager mask block by block, and its mask_mod too, token by token. The compiled
    function is made once a process (torch.compile called for every batch would compile every
    batch anew). Counted with a compiler that runs the captured graph as it is (torch's own
    CompileCounter), a new one for each torch.compile call, as inductor's is: the graph is what
    inductor gets, and this test runs on every CPU. A fresh compile: none from earlier tests."""
    from torch._dynamo.testing import CompileCounter
    counter, real_compile = CompileCounter(), torch.compile
    monkeypatch.setattr(packed_attention, "uses_flex", lambda t: True)  # CUDA's path, on the CPU
    monkeypatch.setattr(torch, "compile", lambda fn, **options: real_compile(
        fn, backend=lambda graph, inputs: counter(graph, inputs), **options))
    fresh = getattr(packed_attention._compiled_block_mask, "cache_clear", lambda: None)  # none made before
    fresh()
    torch._dynamo.reset()
    try:
        for position_ids in random_layouts(20):
            compiled = packed_attention.window_mask(position_ids, torch.float32)
            eager = packed_attention.block_mask(position_ids)
            for name in BLOCK_MASK_TENSORS:
                a, b = getattr(compiled, name), getattr(eager, name)
                assert (a is None) == (b is None) and (a is None or torch.equal(a, b)), name
            B, T = position_ids.shape
            b, q, kv = torch.meshgrid(torch.arange(B), torch.arange(T), torch.arange(T), indexing="ij")
            assert torch.equal(compiled.mask_mod(b, 0, q, kv), eager.mask_mod(b, 0, q, kv))
    finally:
        fresh()  # the counted compile is this test's alone
    assert counter.frame_count == 1, f"{counter.frame_count} compiles for 20 layouts of one shape"


def blocks_listed(num_blocks, indices, blocks: int) -> torch.Tensor:
    """A BlockMask's blocks of one row and head, queries and keys of one length, as a (blocks,
    blocks) bool table: block i lists num_blocks[i] of the other's in indices[i] (None: none)."""
    table = torch.zeros(blocks, blocks, dtype=torch.bool)
    for i, n in enumerate([] if num_blocks is None else num_blocks.tolist()):
        table[i, indices[i, :n]] = True
    return table


def test_the_block_mask_lists_for_every_row_exactly_the_blocks_its_own_windows_need():
    """Flex attention computes the blocks a BlockMask lists and no other: for each row of the
    batch, each block of 128 queries against each block of 128 keys is skipped where the row's
    mask (window_mask's, the CPU's, the same positions) allows no pair, applied pair by pair
    where it allows some, and computed whole where it allows every pair (the rows' padding past
    T allows none). Listed for the whole batch by its first row (a BlockMask of batch 1, which
    flex broadcasts), a row whose windows fall elsewhere skips blocks it needs, or computes
    blocks it needs not; listing every block partial computes the same and skips nothing.
    Checked row by row, as the queries' blocks list the keys' (forward) and the keys' the
    queries' (backward), on rows whose windows end in other places, and mask_mod pair by pair.
    (Made eagerly: the compiled BlockMask equals the eager one, test above.)"""
    T, size = 300, 128  # the last blocks short
    layouts = torch.stack([torch.arange(5).repeat(T // 5),  # windows of 5: only the diagonal's blocks
                           torch.arange(T),  # one window: every block up to the diagonal, full below it
                           torch.cat([torch.arange(128), torch.arange(T - 128)]),  # a window ends with a block
                           torch.cat([torch.arange(100), torch.arange(100), torch.arange(100)])])  # windows across
    for position_ids in [layouts, *random_layouts(3, B=4, T=T, seed=1)]:
        block_mask = packed_attention.block_mask(position_ids)
        allowed = packed_attention.window_mask(position_ids, torch.float32)[:, 0] == 0  # (B, T, T)
        B, n = len(position_ids), -(-T // size)
        pairs = F.pad(allowed, (0, n * size - T, 0, n * size - T)).view(B, n, size, n, size)
        needed, whole = pairs.any(4).any(2), pairs.all(4).all(2)  # (B, query blocks, key blocks)
        for b in range(B):
            def row(name):  # row b's (head 0's), where the batch is broadcast too
                t = getattr(block_mask, name)
                return t if t is None else t[b if t.shape[0] > 1 else 0, 0]
            full = blocks_listed(row("full_kv_num_blocks"), row("full_kv_indices"), n)
            partial = blocks_listed(row("kv_num_blocks"), row("kv_indices"), n)
            assert torch.equal(full, whole[b]) and torch.equal(partial, needed[b] & ~whole[b]), f"row {b}"
            assert torch.equal(blocks_listed(row("full_q_num_blocks"), row("full_q_indices"), n).T, full)
            assert torch.equal(blocks_listed(row("q_num_blocks"), row("q_indices"), n).T, partial)
        b, q, kv = torch.meshgrid(torch.arange(B), torch.arange(T), torch.arange(T), indexing="ij")
        assert torch.equal(block_mask.mask_mod(b, 0, q, kv), allowed)


@pytest.mark.compile
@compiles_flex_on_this_cpu
def test_flex_attention_called_eagerly_after_a_compiled_model_is_still_the_compiled_kernel(monkeypatch):
    """A compiled model (--pack --compile) calls packed_attention.flex_attention while it is being
    traced, where torch.compile is a no-op. An eager call after it (a benchmark, an uncompiled
    evaluation) must still get the compiled kernel, not torch's reference implementation, which
    computes every score (on an H200, 64 rows of 512: 39.9 ms a layer against 10.5). On the CPU, forward only;
    torch marks its reference path with a warning, counted here."""
    import torch.nn.attention.flex_attention as flex_module
    unfused = []
    monkeypatch.setattr(flex_module, "_warn_once", lambda *args, **kwargs: unfused.append(kwargs or args))
    packed_attention._compiled_flex.cache_clear()  # as in a fresh process: nothing compiled yet
    q, k, v, position_ids = (t.detach() for t in attention_inputs(128))
    mask = packed_attention.block_mask(position_ids)
    in_a_compiled_model = torch.compile(lambda q, k, v: packed_attention.flex_attention(q, k, v, mask), backend="eager")
    with torch.no_grad():
        in_a_compiled_model(q, k, v)
        assert not unfused
        packed_attention.flex_attention(q, k, v, mask)  # eagerly, after it
    assert not unfused, f"flex attention ran unfused: {unfused}"


# ---- the model ------------------------------------------------------------------------------

def small_model(layers=2):
    torch.manual_seed(0)
    return LlamaForPretraining(LlamaConfig(vocab_size=300, max_position_embeddings=512, hidden_size=64,
                                           intermediate_size=128, num_hidden_layers=layers, num_attention_heads=4,
                                           num_key_value_heads=2))


def both_layouts(seq_len=300, seed=0):
    """The same windows one to a row (padded) and several to a row (packed): 300 positions, two
    blocks of queries; windows of every length up to a row. Returns both batches and the packing."""
    lengths = np.random.default_rng(seed).integers(2, seq_len + 2, 40).tolist()
    windows = stored_windows(lengths, seed, vocab_size=300)  # small_model's
    padded = PaddedSequenceDataset(windows, seq_len, pad_id=0)
    packed = PackedSequenceDataset(windows, seq_len, pad_id=0, packing=packing.pack(windows, seq_len, seed))
    assert len(packed) < len(padded)
    return (torch.utils.data.default_collate(padded.__getitems__(list(range(len(padded))))),
            torch.utils.data.default_collate(packed.__getitems__(list(range(len(packed))))), packed.packing)


def per_token_losses_and_gradients(model, x, y, position_ids=None, cu_seqlens=None):
    """Each real target's loss, in the order the targets come row after row, and the gradients
    of their sum."""
    model.zero_grad(set_to_none=True)
    logits = model(x, position_ids=position_ids, cu_seqlens=cu_seqlens)
    real = y != IGNORE_INDEX
    losses = F.cross_entropy(logits[real], y[real], reduction="none")
    losses.sum().backward()
    return [losses.detach(), *(p.grad.clone() for p in model.parameters())]


def padded_reference(model, padded):
    """The padded layout's per-token losses and gradients, and the floor: the same computed
    with the rows in reverse order (the same tokens, summed in another order)."""
    x, y = padded
    plain = per_token_losses_and_gradients(model, x, y)
    flipped = per_token_losses_and_gradients(model, x.flip(0), y.flip(0))
    # the flipped run lists the rows' targets in reverse row order: put them back
    counts = (y != IGNORE_INDEX).sum(1).tolist()
    flipped[0] = torch.cat(list(reversed(flipped[0].split(counts[::-1]))))
    floor = max(relative_distance(flipped, plain), torch.finfo(torch.float32).eps)
    return plain, floor


def packed_in_padded_order(model, packed, packing, padded_y):
    """The packed layout's per-token losses, reordered to the padded layout's (window by window)."""
    result = per_token_losses_and_gradients(model, *packed)
    fills = (padded_y != IGNORE_INDEX).sum(1).tolist()  # each window's targets
    order = [w for r in range(len(packing)) for w in packing[r]["windows"]]
    by_window = dict(zip(order, result[0].split([fills[w] for w in order])))
    result[0] = torch.cat([by_window[w] for w in range(len(fills))])
    return result


def test_a_packed_row_computes_exactly_what_its_windows_compute_alone(monkeypatch):
    """Per token, the loss of every target, and every gradient, against the same windows one
    to a row, within FLOOR_MULTIPLE x the floor measured here; and a mask that lets a window
    see the windows before it in its row is caught by that bound."""
    model = small_model()
    padded, packed, packing = both_layouts()
    plain, floor = padded_reference(model, padded)
    distance = relative_distance(packed_in_padded_order(model, packed, packing, padded[1]), plain)
    assert_within("packed vs padded", distance, floor, FLOOR_MULTIPLE)

    real_mask = packed_attention.window_mask
    monkeypatch.setattr(packed_attention, "window_mask",  # the mutant: one window a row, every earlier token seen
                        lambda position_ids, dtype, cu_seqlens=None: real_mask(torch.zeros_like(
                            position_ids[:, :1]).expand_as(position_ids).cumsum(1), dtype))
    leaking = relative_distance(packed_in_padded_order(model, packed, packing, padded[1]), plain)
    assert_far("a leaking mask vs padded", leaking, floor)


def varlen_reference(q, k, v, cu_seq_q, cu_seq_k, max_q, max_k, window_size, enable_gqa):
    """varlen_attn as its documentation defines it, one sequence at a time: q, k and v (N,
    heads, D), the sequences between consecutive cu_seqlens, each attending to itself alone
    (window_size (-1, 0): causally). The plain formulation of CUDA's kernel, on any device."""
    assert torch.equal(cu_seq_q, cu_seq_k) and max_q == max_k and window_size == (-1, 0) and enable_gqa
    ends = cu_seq_q.tolist()
    assert ends[0] == 0 and ends[-1] == q.shape[0] and all(0 <= b - a <= max_q for a, b in zip(ends, ends[1:]))
    return torch.cat([F.scaled_dot_product_attention(*(t[a:b].transpose(0, 1) for t in (q, k, v)), is_causal=True,
                                                     enable_gqa=True).transpose(0, 1)
                      for a, b in zip(ends, ends[1:]) if b > a])


def test_varlen_over_the_loaders_cu_seqlens_computes_what_each_window_computes_alone(monkeypatch):
    """--packed-attention varlen's path through the model (the windows laid end to end, the
    kernel, the output put back in rows), with the kernel's plain formulation standing in for
    CUDA's: every target's loss and every gradient against the windows one to a row, within the
    floor; and bounds that let a row's windows see each other are caught."""
    calls = []
    monkeypatch.setattr(packed_attention, "_varlen_attn", lambda *args, **kwargs: calls.append(1) or
                        varlen_reference(*args, **kwargs))
    model = small_model()
    model.packed_attention = "varlen"
    padded, packed, packing = both_layouts()
    plain, floor = padded_reference(model, padded)
    assert_within("varlen vs padded", relative_distance(packed_in_padded_order(model, packed, packing, padded[1]),
                                                        plain), floor, FLOOR_MULTIPLE)
    assert len(calls) == len(model.base_model.layers)  # the kernel served every layer, not the mask
    with pytest.raises(ValueError, match="needs the rows' cu_seqlens"):  # never flex in its place, unasked
        model(packed[0], packed[1], packed[2])
    monkeypatch.setattr(packed_attention, "windows_end_to_end",  # the mutant: each row one window
                        lambda cu_seqlens, T: packed_attention.Windows(
                            torch.arange(0, cu_seqlens.shape[0] * T + 1, T, dtype=torch.int32), T))
    leaking = relative_distance(packed_in_padded_order(model, packed, packing, padded[1]), plain)
    assert_far("varlen over whole rows vs padded", leaking, floor)


def rotated_queries_and_keys(model, x, position_ids=None) -> list[torch.Tensor]:
    """The first layer's queries and keys after RoPE, (B, T, heads x D) each."""
    import model as model_module
    seen, real = [], model_module.apply_rotary_pos_emb

    def record(q, k, cos, sin):
        seen.append([t.transpose(1, 2).flatten(2) for t in real(q, k, cos, sin)])
        return real(q, k, cos, sin)
    model_module.apply_rotary_pos_emb = record
    try:
        with torch.no_grad():
            model(x, position_ids=position_ids)
    finally:
        model_module.apply_rotary_pos_emb = real
    return seen[0]


def test_each_window_is_rotated_from_position_0_as_it_is_alone(monkeypatch):
    """RoPE sees only the distance between a query and a key, so positions that ran on across
    the row would change the losses by rounding alone; but they would rotate every query and
    key of a later window by other angles. Each window's are those of its own row, to rounding,
    and the positions running on are caught."""
    model = small_model()
    (x, y), (px, py, position_ids, _), packing = both_layouts()
    alone = rotated_queries_and_keys(model, x)
    fills = (y != IGNORE_INDEX).sum(1).tolist()
    order = [w for r in range(len(packing)) for w in packing[r]["windows"]]

    def distance(packed):
        worst = 0.0
        for a, p in zip(alone, packed):
            tokens = p[py != IGNORE_INDEX].split([fills[w] for w in order])  # row after row, each row's windows in turn
            for w, t in zip(order, tokens):
                worst = max(worst, ((t - a[w, :fills[w]]).abs().max() / a[w].abs().max()).item())
        return worst

    floor = torch.finfo(torch.float32).eps
    assert_within("rotated q and k, packed vs alone", distance(rotated_queries_and_keys(model, px, position_ids)),
                  floor, FLOOR_MULTIPLE)
    rope = LlamaRotaryEmbedding.forward
    monkeypatch.setattr(LlamaRotaryEmbedding, "forward",  # the mutant: positions 0 .. T - 1 along the whole row
                        lambda self, T, start=0, position_ids=None: rope(self, T, start))
    running_on = distance(rotated_queries_and_keys(model, px, position_ids))
    assert_far("positions running on vs alone", running_on, floor)


def test_rows_split_by_dataparallel_compute_what_the_whole_batch_computes():
    """nn.DataParallel splits every input along the batch, one part a GPU: a packed row's
    structure (its position_ids) travels with its row, and no replica needs another's rows.
    The CPU has no replicas: the batch is split here as DataParallel's scatter splits it.
    The floor: the whole batch in reverse order."""
    model = small_model()
    _, batch, _ = both_layouts()
    with torch.no_grad():
        whole = model(*batch)
        flipped = model(*(t.flip(0) for t in batch))
        parts = [model(*inputs) for inputs in zip(*(t.chunk(3) for t in batch))]
    loss_sums, counts = (torch.cat(column) for column in zip(*parts))
    assert counts.sum() == whole[1]
    floor = max(((flipped[0] - whole[0]).abs() / whole[0]).item(), torch.finfo(torch.float32).eps)
    assert_within("split rows vs the whole batch", ((loss_sums.sum() - whole[0]).abs() / whole[0]).item(), floor,
                  FLOOR_MULTIPLE)


def test_activation_checkpointing_recomputes_a_packed_row_bitwise():
    _, (x, y, position_ids, _), _ = both_layouts()
    grads = []
    for checkpointing in (False, True):
        model = small_model()
        if checkpointing:
            model.enable_activation_checkpointing()
        model(x, y, position_ids)[0].sum().backward()
        grads.append([p.grad for p in model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*grads))


@pytest.mark.compile
def test_a_compiled_model_computes_a_packed_row_as_the_eager_one_does():
    """Compiled (the mask and the query blocks traced with the model), against eager, per token
    and every gradient, within the floor of the eager padded layout."""
    model = small_model()
    padded, packed, packing = both_layouts()
    _, floor = padded_reference(model, padded)
    eager = packed_in_padded_order(model, packed, packing, padded[1])
    model.compile()
    compiled = packed_in_padded_order(model, packed, packing, padded[1])
    assert_within("compiled vs eager, packed", relative_distance(compiled, eager), floor, FLOOR_MULTIPLE)


# ---- memory ---------------------------------------------------------------------------------

@pytest.mark.parametrize("seq_len", [64, 300])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_estimate_counts_what_a_packed_token_adds_to_what_autograd_saves(seq_len, dtype):
    """Packed rows save their own RoPE tables and the mask once, and past one block of queries
    each layer's joined attention output: per token, exactly what the estimate adds."""
    model = small_model(layers=3)
    model.compute_dtype = dtype
    extra = {}
    for B in (2, 4):
        x = torch.randint(3, 300, (B, seq_len))
        position_ids = torch.cat([torch.arange(seq_len // 3), torch.arange(seq_len - seq_len // 3)]).expand(B, -1)
        extra[B] = saved_for_backward(model, x, x, position_ids) - saved_for_backward(model, x, x)
    per_token = (extra[4] - extra[2]) / (2 * seq_len)
    estimated = (memory.activation_bytes_per_token(model.config, dtype, packed_seq_len=seq_len)
                 - memory.activation_bytes_per_token(model.config, dtype))
    assert estimated == per_token


# ---- training runs --------------------------------------------------------------------------

def test_packed_rows_fill_the_start_up_line_and_the_first_metrics_row(runs):
    out, padded = runs("dp_pack", "train_dp.py", PACK), runs("dp", "train_dp.py")
    facts, padded_facts = metrics(out)[0], metrics(padded)[0]
    assert facts["windows"] == padded_facts["windows"] == padded_facts["rows"]
    assert facts["tokens_per_epoch"] == padded_facts["tokens_per_epoch"]
    assert facts["rows"] < facts["windows"]
    assert facts["padding"] == pytest.approx(1 - facts["tokens_per_epoch"] / (facts["rows"] * 32))
    assert facts["padding"] < 0.05 < padded_facts["padding"]
    assert (f"in {facts['windows']:,} windows of 32, packed into {facts['rows']:,} rows "
            f"({facts['padding']:.1%} padding) |") in runs.output["dp_pack"]


# Packed runs over an epoch boundary: 128 rows a step, an epoch of 3 to 5 steps
PACKED_EPOCHS = [*PACK, "--batch-size", "128", "--max-steps", "6", "--log-every", "1", "--save-every", "2",
                 "--eval-every", "2"]


def test_packed_runs_train_the_same_model_under_ddp_with_accumulation_and_under_fsdp_across_epochs(runs, floor):
    """Across an epoch boundary: each epoch's own shuffle of the rows (set_epoch), dealt to every
    rank's share, trains the one process's model; and tokens_seen counts the real targets of the
    rows trained so far, in the sampler's order."""
    one = runs("dp_pack_epochs", "train_dp.py", PACKED_EPOCHS)
    rows = [row for row in metrics(one) if "loss" in row]
    assert {row["epoch"] for row in rows} == {0, 1}
    assert_same_model(runs("ddp2_pack_accum2_epochs", "train_ddp.py", [*PACKED_EPOCHS, "--grad-accum", "2"], nproc=2),
                      one, floor)
    assert_same_model(runs("fsdp2_pack_epochs", "train_fsdp.py", PACKED_EPOCHS, nproc=2), one, floor)
    assert_learns(rows)
    cfg, train_ds = packed_datasets(runs, one, PACKED_EPOCHS)[:2]
    assert [row["tokens_seen"] for row in rows] == [train_ds.targets_before(row["step"], 128, cfg.seed)
                                                    for row in rows]


def test_a_packed_run_resumes_bitwise_across_an_epoch_boundary(runs, tmp_path):
    """Stopped at step 2 and resumed, a packed run reshuffles its rows for epoch 1 exactly as a
    straight run does (the packing is the same in every run with the same seed)."""
    straight = runs("dp_pack_epochs", "train_dp.py", PACKED_EPOCHS)
    per_epoch = int(re.search(r"\| (\d+) steps per epoch \|", runs.output["dp_pack_epochs"]).group(1))
    assert 2 < per_epoch < 6  # stopped at 2, resumed across the boundary
    assert [row["epoch"] for row in metrics(straight) if "loss" in row] == [0] * per_epoch + [1] * (6 - per_epoch)
    half = runs.copy(runs("dp_pack_epochs_half", "train_dp.py", [*PACKED_EPOCHS, "--stop-at-step", "2"]),
                     tmp_path / "half")
    train("train_dp.py", ["--dataset", str(runs.corpus), *FAST, *PACKED_EPOCHS, "--out-dir", str(half), "--resume"])
    assert_same_model(half, straight)


def packed_datasets(runs, out, flags=PACK):
    """(the flags, the training and the held-out datasets) of a packed run, made again here."""
    cfg = config.parse_args(["--dataset", str(runs.corpus), *FAST, *flags, "--out-dir", str(runs.root / "unused")])
    documents, tokenizer = run_data.Corpus(cfg), tokenized.load_tokenizer(out / "tokenizer.json")
    return cfg, documents.training_rows(tokenizer), run_data.make_dataset(cfg, tokenizer, documents.val_text,
                                                                          text_bytes=True)


def test_a_packed_evaluation_gives_the_padded_evaluations_loss_and_bits_per_byte(runs, floor):
    """The run's last val_loss and val_bpb (step 8, its final weights), from its packed held-out
    rows, against the same weights evaluated one window a row. The floor: that padded
    evaluation in reverse order. The held-out rows are packed as the training rows are (the
    same loss either way: only their number of rows says so), so that evaluation costs what
    training does."""
    out = runs("dp_pack", "train_dp.py", PACK)
    cfg, _, packed_val = packed_datasets(runs, out)
    padded_val = PaddedSequenceDataset(packed_val.rows, 32, packed_val.pad_id, text_bytes=packed_val.text_bytes)
    assert isinstance(packed_val, PackedSequenceDataset) and len(packed_val) < len(padded_val)
    model = build.model(cfg, 300, torch.float32)
    model.load_state_dict(load_weights(out))
    last = [row for row in metrics(out) if "val_loss" in row][-1]

    def evaluated(ds, order):
        loader = torch.utils.data.DataLoader(torch.utils.data.Subset(ds, order), batch_size=8)
        loss_sum, n = evaluation.evaluate(model, loader, torch.device("cpu"))
        return loss_sum / n, evaluation.bits_per_byte(loss_sum, ds)

    padded = evaluated(padded_val, range(len(padded_val)))
    reversed_order = evaluated(padded_val, range(len(padded_val) - 1, -1, -1))
    packed = evaluated(packed_val, range(len(packed_val)))
    loss_floor = max(abs(reversed_order[0] - padded[0]).item() / padded[0].item(), floor.loss)
    assert_within("packed val loss vs padded", abs(packed[0] - padded[0]).item() / padded[0].item(), loss_floor,
                  FLOOR_MULTIPLE)
    assert_within("logged val loss vs padded", abs(last["val_loss"] - padded[0].item()) / padded[0].item(),
                  loss_floor, FLOOR_MULTIPLE)
    assert last["val_bpb"] == pytest.approx(padded[1], rel=FLOOR_MULTIPLE * loss_floor)


@pytest.mark.parametrize("stopped_with, resumed_with, message", [
    (PACK, [], "was trained with --pack (its rows hold several windows each): resume with --pack"),
    ([], PACK, "was trained without --pack (its rows hold one window each): resume without --pack")])
def test_a_resume_with_the_other_framing_is_one_line_and_touches_nothing(runs, tmp_path, capsys, stopped_with,
                                                                        resumed_with, message):
    if stopped_with:
        half = runs.copy(runs("dp_pack_stop4", "train_dp.py", [*PACK, "--stop-at-step", "4"]), tmp_path / "half")
    else:
        half = stopped_at_step_4(runs, tmp_path)
    refused_in_process("train_dp.py", ["--dataset", str(runs.corpus), *FAST, *resumed_with, "--resume"], half,
                       message, capsys)


def test_a_packed_resume_on_other_rows_is_one_line_and_touches_nothing(runs, tmp_path, monkeypatch, capsys):
    """A checkpoint records which windows each row held. Resumed where the packing differs
    (its cache replaced by another valid packing, another machine's cache), the run would
    continue elsewhere in the data than it stopped: refused."""
    half = runs.copy(runs("dp_pack_stop4", "train_dp.py", [*PACK, "--stop-at-step", "4"]), tmp_path / "half")
    real_pack = packing.pack
    monkeypatch.setattr(packing, "pack", lambda windows, seq_len, seed: real_pack(windows, seq_len, seed + 1))
    refused_in_process("train_dp.py", ["--dataset", str(runs.corpus), *FAST, *PACK, "--resume"], half,
                       "--pack's rows (which windows each row holds) are not those checkpoint.pt trained on", capsys)


def test_init_from_a_padded_run_starts_a_packed_one_at_its_trained_weights(runs, tmp_path):
    """Weights are weights: a packed run from a padded run's model.pt begins near where the
    padded run ended, far below where a run from the seed begins."""
    padded = runs("dp", "train_dp.py")
    out = tmp_path / "packed"
    train("train_dp.py", ["--dataset", str(runs.corpus), *FAST_WITH_TOKENIZER, *PACK, "--max-steps", "2", "--log-every", "1",
                          "--init-from", str(padded), "--out-dir", str(out)])
    first = next(row["loss"] for row in metrics(out) if "loss" in row)
    ended = [row["loss"] for row in metrics(padded) if "loss" in row]
    assert abs(first - ended[-1]) < 0.5 * (ended[0] - ended[-1])
