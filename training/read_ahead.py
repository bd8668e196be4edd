"""The data feed: each step's micro-batches read, pinned and copied to the device while the step
before runs, so that the GPU never waits for the host to read a batch.

Without it the loader reads the next batch only once the host has queued the step: on an H100
(article, --pack, compiled, 64 x 512) that wait was 7.2% of every step (data_wait_fraction).
One thread reads one step ahead, in the loader's order: the same samples in the same order as
reading them in turn, so a resumed run still continues bitwise.
"""

import queue
import threading
import weakref

import torch

from training import stopping
from training.profiling import DATA_WAIT_MARK


def on_device(batch, device: torch.device) -> tuple:
    """A batch's tensors on the device: (inputs, targets), and for rows that hold several
    windows (--pack) their position_ids and cu_seqlens. non_blocking: from pinned memory
    (a CUDA loader's pin_memory), the copy does not hold up the host."""
    return tuple(t.to(device, non_blocking=True) for t in batch)


class ReadAhead:
    """next(read_ahead): the `grad_accum` micro-batches of the next step, on the device, for
    `steps` steps of `loader` (those of this epoch the run will train). A thread reads the
    step after the one just handed out while it runs: it takes the loader's batches in their
    order (the loader's sampler is not touched while it reads), pins them (the loader's
    pin_memory) and, on CUDA, starts their copy on a stream of its own; the step's stream
    waits for that copy, not for the host. Its errors are raised by next()."""

    def __init__(self, loader, grad_accum: int, device: torch.device, steps: int):
        batches = iter(loader)  # here, not in the thread: a loader's iterator draws its seed from torch's RNG
        if device.type == "cuda" and device.index is None:  # "cuda": this thread's GPU, which the reader's is not
            device = torch.device("cuda", torch.cuda.current_device())
        self.ready = queue.Queue(maxsize=1)  # the next step; the thread reads the one after meanwhile
        self.device, self.steps = device, steps
        stop = threading.Event()
        thread = threading.Thread(target=_read, args=(batches, grad_accum, device, steps, self.ready, stop),
                                  name="read-ahead", daemon=True)
        thread.start()

        def end():  # stop reading ahead, and wait for a read under way
            stop.set()
            thread.join()
        # A run that ends before its last step (an error, a signal) ends the thread first, before
        # the interpreter does: a thread still reading in C++ when Python ends it aborted the
        # process ("terminate called without an active exception", exit -6 instead of our 2).
        stopping.finish_before_exit(end, "the batches being read ahead")
        weakref.finalize(self, stop.set)  # and a reader dropped mid-epoch stops once collected

    def __iter__(self):
        return self

    def __next__(self) -> list:
        if self.steps == 0:
            raise StopIteration
        self.steps -= 1
        with torch.profiler.record_function(DATA_WAIT_MARK):  # --profile: the loop waiting for its batches
            micro_batches, copied = self.ready.get()
        if isinstance(micro_batches, BaseException):
            raise micro_batches
        if copied is not None:  # CUDA: the step waits for the copy; the copy's memory for the step
            stream = torch.cuda.current_stream(self.device)
            stream.wait_event(copied)
            for batch in micro_batches:
                for t in batch:
                    t.record_stream(stream)
        return micro_batches


def _read(batches, grad_accum: int, device: torch.device, steps: int, ready: queue.Queue, stop: threading.Event):
    """The thread: `steps` steps of `grad_accum` batches each, handed over one at a time."""
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.set_device(device)  # a new thread starts on GPU 0: pinning there would open a context on it
        stream = torch.cuda.Stream(device)
    try:
        for _ in range(steps):
            if cuda:
                with torch.cuda.stream(stream):
                    step = [on_device(next(batches), device) for _ in range(grad_accum)]
                    copied = torch.cuda.Event()
                    copied.record(stream)
            else:
                step, copied = [on_device(next(batches), device) for _ in range(grad_accum)], None
            if not _hand_over(ready, (step, copied), stop):
                return
    except StopIteration:
        _hand_over(ready, (RuntimeError(f"the loader ran out before the {steps} steps it was read ahead for"), None),
                   stop)
    except BaseException as e:  # a damaged row, a full disk: raised where the step asks for it
        _hand_over(ready, (e, None), stop)


def _hand_over(ready: queue.Queue, item, stop: threading.Event) -> bool:
    """Put item in the queue once there is room; False if the run stopped waiting first."""
    while not stop.is_set():
        try:
            ready.put(item, timeout=0.1)  # a bounded wait, so that a stop is seen
            return True
        except queue.Full:
            continue
    return False
