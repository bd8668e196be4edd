"""The data feed (training/read_ahead.py): each step's micro-batches are read while the step
before runs, the same samples in the same order as reading them in turn; the reader's errors
reach the training loop, and a run that ends early ends its reader. Proven by what waits for
what, never by timing: a step that must see its successor's read begin before it can finish
would wait forever without the read-ahead (each wait is bounded, and fails the test)."""

import gc
import threading

import pytest
import torch

import data
import model as model_module
from conftest import FAST, metrics, script_in_process
from training import run_data
from training.read_ahead import ReadAhead

CPU = torch.device("cpu")
PATIENCE = 60  # seconds a wait may take before the test calls it a deadlock


class Recorded(torch.utils.data.Dataset):
    """Items 0 .. n-1 (one tensor each); `started[i]` is set when item i's read begins, and
    reading item `fail_at` raises."""

    def __init__(self, n: int, fail_at: int | None = None):
        self.n, self.fail_at = n, fail_at
        self.started = [threading.Event() for _ in range(n)]

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        self.started[i].set()
        if i == self.fail_at:
            raise ValueError(f"row {i} is damaged")
        return (torch.tensor([i]),)


def loader(dataset, batch_size=1):
    return torch.utils.data.DataLoader(dataset, batch_size=batch_size)


def test_the_next_step_is_read_while_this_one_runs():
    dataset = Recorded(6)
    batches = ReadAhead(loader(dataset), grad_accum=2, device=CPU, steps=3)
    first = next(batches)
    assert [b[0].item() for b, in first] == [0, 1]
    # nobody asks for step 2: the reader takes its items (2 and 3) by itself, while step 1 "runs"
    assert dataset.started[2].wait(PATIENCE) and dataset.started[3].wait(PATIENCE), "step 2 was not read ahead"


def test_the_steps_are_the_loaders_batches_in_its_order_and_no_more_than_asked():
    shuffled = data.ResumableRandomSampler(range(40), seed=3)  # an order of the loader's own, to keep
    items = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.arange(40)), batch_size=4,
                                        sampler=shuffled)
    in_turn = [batch[0] for batch in items]
    ahead = list(ReadAhead(items, grad_accum=2, device=CPU, steps=3))
    assert len(ahead) == 3 and all(len(step) == 2 for step in ahead)
    assert all(torch.equal(got[0], want) for got, want in zip([b for step in ahead for b in step], in_turn))
    recorded = Recorded(40)
    assert len(list(ReadAhead(loader(recorded, batch_size=4), grad_accum=2, device=CPU, steps=3))) == 3
    assert sum(event.is_set() for event in recorded.started) == 3 * 2 * 4  # 6 batches of 4 read, none after


def test_an_error_in_the_reader_is_raised_where_its_step_is_asked_for():
    batches = ReadAhead(loader(Recorded(6, fail_at=3)), grad_accum=2, device=CPU, steps=3)
    assert [b[0].item() for b, in next(batches)] == [0, 1]
    with pytest.raises(ValueError, match="row 3 is damaged"):
        next(batches)


def test_a_loader_shorter_than_the_steps_is_an_error_not_a_hang():
    batches = ReadAhead(loader(Recorded(3)), grad_accum=2, device=CPU, steps=2)
    next(batches)
    with pytest.raises(RuntimeError, match="ran out before the 2 steps"):
        next(batches)


def reader_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "read-ahead"]


def test_a_run_that_stops_early_ends_its_reader():
    before = reader_threads()
    batches = ReadAhead(loader(Recorded(10)), grad_accum=1, device=CPU, steps=10)
    next(batches)  # then the run stops (a signal, an error): nobody asks for the rest
    (reader,) = [t for t in reader_threads() if t not in before]
    del batches
    gc.collect()
    reader.join(PATIENCE)
    assert not reader.is_alive()


@pytest.mark.parametrize("script", ["train_dp.py", "train_ddp.py", "train_fsdp.py"])
def test_every_script_reads_the_next_step_while_this_one_runs(tmp_path, corpus, monkeypatch, script):
    """A run whose every training forward (but the last step's) waits until the next step's
    batch is being read: it trains to its end only if that read happens meanwhile."""
    reads, forwards = [], []
    next_read = [threading.Event() for _ in range(10)]
    real_getitems, real_forward = data.PaddedSequenceDataset.__getitems__, model_module.LlamaForPretraining.forward
    real_dataset, training_rows = run_data.make_dataset, []

    def make_dataset(*args, **kwargs):
        rows = real_dataset(*args, **kwargs)
        training_rows.append(rows)  # the training rows first, then the held-out ones
        return rows

    def getitems(self, indices):
        if self is training_rows[0]:
            reads.append(threading.current_thread().name)
            next_read[len(reads)].set()
        return real_getitems(self, indices)

    def forward(self, *args, **kwargs):
        if torch.is_grad_enabled():  # a training step (evaluation runs under no_grad)
            forwards.append(1)
            if len(forwards) < 8:  # FAST's --max-steps: no step after the last
                assert next_read[len(forwards) + 1].wait(PATIENCE), f"step {len(forwards) + 1} was not read ahead"
        return real_forward(self, *args, **kwargs)

    monkeypatch.setattr(run_data, "make_dataset", make_dataset)
    monkeypatch.setattr(data.PaddedSequenceDataset, "__getitems__", getitems)
    monkeypatch.setattr(model_module.LlamaForPretraining, "forward", forward)
    out = tmp_path / "out"
    assert script_in_process(script, ["--dataset", str(corpus), *FAST, "--out-dir", str(out)]) == 0
    assert len(reads) == 8 and set(reads) == {"read-ahead"}  # each step's batch once, by the reader
    assert [row["step"] for row in metrics(out) if "loss" in row] == [2, 4, 6, 8]
