"""The data feed: each step's micro-batches read, pinned and copied to the device while the step
before runs, so that the GPU never waits for the host to read a batch.

Without it the loader reads the next batch only once the host has queued the step: on an H100
(article, --pack, compiled, 64 x 512) that wait was 7.2% of every step (data_wait_fraction).
One thread reads one step ahead, in the loader's order: the same samples in the same order as
reading them in turn, so a resumed run still continues bitwise.
"""

import contextlib
import itertools
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
    `steps` steps of `loader` (those of this epoch the run will train; None: until the loader
    ends, as a stream's does, and next() then raises StopIteration). A thread reads the step
    after the one just handed out while it runs: it takes the loader's batches in their order
    (the loader's sampler is not touched while it reads), pins them (the loader's pin_memory)
    and, on CUDA, starts their copy on a stream of its own; the step's stream waits for that
    copy, not for the host. Its errors are raised by next().

    state_dict: the loader's (a stream's feed's), which the thread takes after each step it
    reads; self.state_dict() gives the one after the step last handed out, what a checkpoint
    saves: the loader itself stands a step or two ahead."""

    def __init__(self, loader, grad_accum: int, device: torch.device, steps: int | None, state_dict=None):
        batches = iter(loader)  # here, not in the thread: a loader's iterator draws its seed from torch's RNG
        if device.type == "cuda" and device.index is None:  # "cuda": this thread's GPU, which the reader's is not
            device = torch.device("cuda", torch.cuda.current_device())
        self.ready = ready = queue.Queue(maxsize=1)  # the next step; the thread reads the one after meanwhile
        self.device, self.steps = device, steps
        self._state = state_dict() if state_dict is not None else None  # before any step
        stop = threading.Event()
        thread = threading.Thread(target=_read, args=(batches, grad_accum, device, steps, state_dict, ready, stop),
                                  name="read-ahead", daemon=True)
        thread.start()

        def end():  # stop reading ahead, and wait for a read under way
            stop.set()
            # A step read that the loop will not take: taken here, the thread's wait to hand it over
            # ends now, not at its next look at `stop` (0.1 s): a rank that stops on an error the
            # ranks agreed on leaves as soon as the others, before torchrun ends it for being late.
            with contextlib.suppress(queue.Empty):
                ready.get_nowait()
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
        if self.steps is not None:
            self.steps -= 1
        with torch.profiler.record_function(DATA_WAIT_MARK):  # --profile: the loop waiting for its batches
            micro_batches, copied, state = self.ready.get()
        if isinstance(micro_batches, BaseException):
            if isinstance(micro_batches, StopIteration):
                self.steps = 0  # the loader's end: the thread has stopped, and nothing more comes
            raise micro_batches
        self._state = state
        if copied is not None:  # CUDA: the step waits for the copy; the copy's memory for the step
            stream = torch.cuda.current_stream(self.device)
            stream.wait_event(copied)
            for batch in micro_batches:
                for t in batch:
                    t.record_stream(stream)
        return micro_batches

    def state_dict(self):
        """The loader's state_dict after the step last handed out (given state_dict), else None."""
        return self._state


def _read(batches, grad_accum: int, device: torch.device, steps: int | None, state_dict, ready: queue.Queue,
          stop: threading.Event):
    """The thread: `steps` steps (None: until the loader ends) of `grad_accum` batches each,
    handed over one at a time with the loader's state after them."""
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.set_device(device)  # a new thread starts on GPU 0: pinning there would open a context on it
        stream = torch.cuda.Stream(device)
    try:
        for _ in range(steps) if steps is not None else itertools.count():
            with torch.cuda.stream(stream) if cuda else contextlib.nullcontext():
                step = [on_device(batch, device) for batch in itertools.islice(batches, grad_accum)]
                copied = torch.cuda.Event() if cuda else None
                if cuda:
                    copied.record(stream)
            if not step and steps is None:  # the end of a loader read to its end (a stream's feed)
                _hand_over(ready, (StopIteration(), None, None), stop)
                return
            if len(step) < grad_accum:
                raise RuntimeError(f"the loader ran out before the {steps} steps it was read ahead for"
                                   if steps is not None else "the loader ran out within a step")
            state = state_dict() if state_dict is not None else None  # after this step's batches, not the next's
            if not _hand_over(ready, (step, copied, state), stop) or stop.is_set():
                return
    except BaseException as e:  # a damaged row, a full disk: raised where the step asks for it
        _hand_over(ready, (e, None, None), stop)


def _hand_over(ready: queue.Queue, item, stop: threading.Event) -> bool:
    """Put item in the queue once there is room; False if the run stopped waiting first."""
    while not stop.is_set():
        try:
            ready.put(item, timeout=0.1)  # a bounded wait, so that a stop is seen
            return True
        except queue.Full:
            continue
    return False
