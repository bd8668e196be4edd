"""The output folder and its checkpoints: never overwrite a run, never tear a checkpoint,
resume from the newest one that can be read, and keep saving off the training loop.

Checkpoints hold tensors and plain containers only, so they load with weights_only=True:
a file crafted to run code on load is refused instead.
"""

import dataclasses
import errno
import fcntl
import json
import os
import re
import shutil
import threading
from pathlib import Path

import torch
from tokenizers import Tokenizer

import corpus
import data
from data import load_tokenizer
from errors import UsageError, first_line
from launcher import finish_before_exit, restart_count, warn
from model import LlamaConfig, LlamaForPretraining

CHECKPOINT, MODEL, TOKENIZER, CONFIG, METRICS = (
    "checkpoint.pt", "model.pt", "tokenizer.json", "config.json", "metrics.jsonl")
TENSORBOARD, WANDB_RUN = "tensorboard", "wandb-run.txt"  # --tensorboard's event files, --wandb's run id
RUN_FILES = (CHECKPOINT, MODEL, TOKENIZER, CONFIG, METRICS, TENSORBOARD, WANDB_RUN)  # plus checkpoint-<step>.pt
NUMBERED = re.compile(r"checkpoint-(\d{8,})\.pt")  # checkpoint-00000400.pt: the step, 8 digits or more
NUMBERED_DIR = re.compile(r"checkpoint-(\d{8,})")  # checkpoint-00000400/: a sharded one (train_fsdp.py)


def _by_step(paths, name: re.Pattern) -> list[Path]:
    """The paths whose whole name matches `name`, oldest step (its group 1) first."""
    found = [(int(m.group(1)), p) for p in paths if (m := name.fullmatch(p.name))]
    return [p for _, p in sorted(found)]


def numbered_checkpoints(out: Path) -> list[Path]:
    """The checkpoint-<step>.pt files this trainer wrote, oldest first. Only these exact names
    are ever pruned or resumed from: a user's checkpoint-best.pt or copy is left alone."""
    return _by_step(out.glob("checkpoint-*.pt"), NUMBERED)


def sharded_checkpoints(out: Path) -> list[Path]:
    """The checkpoint-<step>/ folders train_fsdp.py wrote (sharded_checkpointing.py), oldest first."""
    return _by_step((p for p in out.glob("checkpoint-*") if p.is_dir()), NUMBERED_DIR)


_LOCKS = []  # open descriptors of the output folders this process holds, until it exits


def lock_out_dir(out_dir: str):
    """Hold an exclusive lock on the output folder for the rest of this process's life: an
    flock on the folder itself, which the kernel releases when the process dies, however it
    dies. A second run into the same folder fails here, with one line."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    fd = os.open(out, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise UsageError(f"another run is using {out}: wait for it to end, or choose another --out-dir") from None
    _LOCKS.append(fd)
    remove_temp_files(out)  # no other run can be writing them now


def check_writable(out_dir: str, name: str = "--out-dir"):
    """Before any data is loaded: --out-dir must be a folder this process can create or write."""
    if not out_dir:
        raise UsageError(f"{name} is empty: name a folder")
    out = Path(out_dir).absolute()
    if out.exists() and not out.is_dir():
        raise UsageError(f"{name} {out_dir} exists and is not a folder")
    dangling = next((p for p in [out, *out.parents] if p.is_symlink() and not p.exists()), None)
    if dangling:
        raise UsageError(f"{name} {out_dir}: {dangling} is a link to {os.readlink(dangling)}, which does not exist; "
                         "create that folder or choose another")
    existing = next(p for p in [out, *out.parents] if p.exists())
    if not existing.is_dir():
        raise UsageError(f"{name} {out_dir}: {existing} is a file, not a folder")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise UsageError(f"{name} {out_dir}: no permission to write in {existing}")


def resuming(out_dir: str, resume: bool) -> bool:
    """Whether this run continues the one in out_dir: on --resume, or when torchrun restarts
    the job after a failure. Checked before anything is written: a new run refuses a folder
    that holds another run."""
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise UsageError(f"--out-dir {out} exists and is not a folder")
    # where the run writes a file, a folder or a FIFO would fail its write after training
    files = [out / name for name in RUN_FILES if name != TENSORBOARD] + numbered_checkpoints(out)
    if in_the_way := next((p for p in files if os.path.lexists(p) and not p.is_file()), None):
        raise UsageError(f"{in_the_way} is not a regular file, and this run writes a file there: move it away")
    checkpoints = [p for p in [out / CHECKPOINT, *numbered_checkpoints(out)] if p.is_file()]
    checkpoints += sharded_checkpoints(out)
    if resume or (restart_count() and checkpoints):
        if not checkpoints:
            raise UsageError(f"nothing to resume: {out} holds no checkpoint")
        return True
    if restart_count():
        return False  # killed before its first checkpoint: start again over this job's own files
    existing = [name for name in RUN_FILES if (out / name).exists()]
    if checkpoints or (out / MODEL).exists():
        raise UsageError(f"{out} already holds a run ({', '.join(existing) or checkpoints[0].name}): "
                         "pass --resume to continue it, or choose another --out-dir")
    if existing:
        raise UsageError(f"{out} holds files of a run that never saved a checkpoint "
                         f"({', '.join(existing)}): delete them, or choose another --out-dir")
    return False


def load_latest_checkpoint(out_dir) -> dict:
    """checkpoint.pt or, if it cannot be read, the newest older checkpoint that can."""
    out = Path(out_dir)
    candidates = [out / CHECKPOINT, *reversed(numbered_checkpoints(out))]
    failures = []
    for path in (p for p in candidates if os.path.lexists(p)):  # a FIFO or a dangling link is one failure more
        try:
            ckpt = load_checkpoint(path)
        except UsageError as e:
            failures.append(str(e))
            continue
        if failures:
            warn(f"{failures[0]}; falling back to {path.name}")
        ckpt["path"], ckpt["inode"] = str(path), path.stat().st_ino
        return ckpt
    raise UsageError(failures[0] if failures else f"{out} holds no checkpoint")


def load_pt(path, what: str):
    """Read any .pt file of a run. weights_only: tensors and plain containers only, so a
    crafted file cannot run code; map_location: every rank loads onto the CPU instead of
    all onto GPU 0; mmap: the tensors stay in the file (the page cache, shared by every rank
    of a node) until they are copied where they belong, instead of a private copy of the
    weights and optimizer state in each rank's memory. A file that cannot be read is one
    UsageError line."""
    corpus.regular_file(path, what)  # a FIFO would block torch.load, a device feed it forever
    try:
        try:
            return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except RuntimeError as e:
            if "mmap can only be used" not in str(e):
                raise
            # torch.save's legacy format (_use_new_zipfile_serialization=False) cannot be
            # memory-mapped: read whole, as safely
            return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:
        raise UsageError(f"cannot load {what} {path}: {first_line(e)}") from None


def load_checkpoint(path) -> dict:
    ckpt = load_pt(path, "checkpoint")
    check_checkpoint(ckpt, path)
    return ckpt


# What run_state writes (and checkpoint_state adds), by kind: a resume reads each
RUN_STATE_KINDS = {"train_config": dict, "model_config": dict, "scheduler": dict, "rng": dict, "step": int,
                   "steps_per_epoch": int}


def check_checkpoint(ckpt, path, sharded: bool = False):
    """A checkpoint of this trainer holds what run_state wrote, of the kinds it wrote: anything
    else is one line here (and the run falls back to an older checkpoint), not a traceback
    later, nor a run that trains on from a step it never reached."""
    kinds = {**RUN_STATE_KINDS, **({} if sharded else {"model": dict, "optimizer": dict})}
    if not isinstance(ckpt, dict) or not kinds.keys() <= ckpt.keys():
        raise UsageError(f"{path} is not a checkpoint of this trainer")
    for key, kind in kinds.items():
        if not isinstance(ckpt[key], kind) or isinstance(ckpt[key], bool):
            raise UsageError(f"{path} is damaged: its {key} is not a {kind.__name__}, as this trainer saves it")
    if ckpt["step"] < 0 or ckpt["steps_per_epoch"] < 1 or not isinstance(ckpt.get("corpus", {}), (dict, type(None))):
        raise UsageError(f"{path} is damaged: step {ckpt['step']}, {ckpt['steps_per_epoch']} steps per epoch")


def checkpoint_state(model, optimizer, scheduler, cfg, step, train_ds) -> dict:
    return {"model": model.state_dict(),  # the plain module: no `module.` / `_orig_mod.` prefixes
            "optimizer": optimizer.state_dict(),
            **run_state(model, scheduler, cfg, step, train_ds)}


def run_state(model, scheduler, cfg, step, train_ds) -> dict:
    """Everything in a checkpoint besides the model's and the optimizer's tensors."""
    steps_per_epoch = len(train_ds) // cfg.batch_size
    epoch, step_in_epoch = divmod(step, steps_per_epoch)
    return {
        "scheduler": scheduler.state_dict(),
        "step": step, "epoch": epoch, "step_in_epoch": step_in_epoch, "steps_per_epoch": steps_per_epoch,
        "framing": data.framing(cfg.pack),  # how documents became rows: a resume needs the same rows
        "corpus": train_ds.corpus,  # what data the run trains on (corpus.fingerprint): a resume must match it
        # Nothing in training draws random numbers after initialization (the data order comes
        # from seed + epoch), but saving the generators keeps any future dropout exact too.
        # The CUDA generator only where the model is on a GPU: reading it opens a CUDA context
        # (0.3-0.5 GiB of GPU 0), which a run with --device cpu on a GPU machine must not.
        "rng": {"torch": torch.get_rng_state(),
                "cuda": torch.cuda.get_rng_state() if next(model.parameters()).device.type == "cuda" else None},
        "model_config": dataclasses.asdict(model.config),
        "train_config": dataclasses.asdict(cfg),
    }


def restore(ckpt: dict, model, optimizer, scheduler) -> int:
    """Load a checkpoint into freshly built objects (on every rank); return its step."""
    model.load_state_dict(ckpt["model"])  # copies into the parameters
    optimizer.load_state_dict(ckpt["optimizer"])
    # On the CPU the optimizer keeps the loaded tensors themselves, which live in the
    # checkpoint's memory-mapped file (load_pt): copies of its own let the file go, so that
    # its disk space is freed once a newer checkpoint replaces it.
    for state in optimizer.state.values():
        for key, value in state.items():
            if isinstance(value, torch.Tensor) and value.device.type == "cpu":
                state[key] = value.clone()
    return restore_run_state(ckpt, scheduler)


def restore_run_state(ckpt: dict, scheduler) -> int:
    """What run_state saved, back in place; returns the step."""
    scheduler.load_state_dict(ckpt["scheduler"])
    torch.set_rng_state(ckpt["rng"]["torch"])
    if ckpt["rng"]["cuda"] is not None and torch.cuda.is_initialized():  # a run on a GPU (see run_state)
        torch.cuda.set_rng_state(ckpt["rng"]["cuda"])
    return ckpt["step"]


def atomic_save(obj, path: Path):
    """Write to a temp file, flush it to disk, then rename: a crash mid-write leaves the
    previous file intact, never a torn one. A failed write removes its temp file, and a
    full disk is one line that says where and how much space is missing."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        with open(tmp, "wb") as f:
            if isinstance(obj, str):
                f.write(obj.encode())
            else:
                torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())  # the bytes are on disk before the rename makes them visible
        os.replace(tmp, path)
    except Exception as e:
        tmp.unlink(missing_ok=True)
        raise_if_disk_full(e, path, _nbytes(obj))
        raise
    _fsync_dir(path.parent)


def raise_if_disk_full(error: BaseException, path: Path, needed: int):
    """Turn a write that failed for want of space into one UsageError line."""
    message = disk_full(error, path, needed)
    if message:
        raise UsageError(message) from None


def disk_full(error: BaseException, path: Path, needed: int) -> str | None:
    """The line for a write of `needed` bytes to `path` that failed for want of space, or None
    if it failed for another reason. torch.save does not always say so itself ("unexpected
    pos"): then the free space decides."""
    try:
        free = shutil.disk_usage(path.parent).free
    except OSError:
        return None
    if getattr(error, "errno", None) in (errno.ENOSPC, errno.EDQUOT) or free < needed:
        mount = next(p for p in [path.parent.absolute(), *path.parent.absolute().parents] if os.path.ismount(p))
        return (f"no space left to write {path} (on the disk mounted at {mount}): it needs about "
                f"{needed / 1e6:,.1f} MB, {free / 1e6:,.1f} MB are free. Free some space, then run again "
                "(with --resume if a checkpoint was saved)")
    return None


def _nbytes(obj) -> int:
    """About how many bytes saving obj writes: its tensors' and strings' sizes."""
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, str):
        return len(obj.encode())
    if isinstance(obj, dict):
        return sum(_nbytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(_nbytes(v) for v in obj)
    return 8


def remove_temp_files(out: Path):
    """Delete the temp files a crash (or a full disk) left behind in a run's folder: only the
    names atomic_save gives, and only while this run holds the folder's lock."""
    ours = [out / (name + ".tmp") for name in RUN_FILES]
    ours += [p for p in out.glob("checkpoint-*.tmp") if NUMBERED.fullmatch(p.name[:-len(".tmp")])
             or NUMBERED_DIR.fullmatch(p.name[:-len(".tmp")])]
    for tmp in ours:
        if tmp.is_dir() and not tmp.is_symlink():
            shutil.rmtree(tmp)  # a sharded checkpoint that not every rank finished
        else:
            tmp.unlink(missing_ok=True)


def _fsync_dir(folder: Path):
    fd = os.open(folder, os.O_RDONLY)  # makes the rename itself durable
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save_checkpoint(state: dict, out_dir, keep: int):
    """Write checkpoint-<step>.pt, then make checkpoint.pt a second name for it with one
    atomic rename, then delete all but the newest `keep` numbered checkpoints. At every
    moment checkpoint.pt is a complete checkpoint: the previous one or this one."""
    out = Path(out_dir)
    numbered = out / f"checkpoint-{state['step']:08d}.pt"
    atomic_save(state, numbered)
    link = out / (CHECKPOINT + ".tmp")
    link.unlink(missing_ok=True)  # a leftover of a crash
    try:
        os.link(numbered, link)
    except OSError:  # a file system without hard links
        shutil.copyfile(numbered, link)
    os.replace(link, out / CHECKPOINT)
    _fsync_dir(out)
    for old in to_prune(numbered_checkpoints(out), numbered, keep):
        old.unlink()


def to_prune(checkpoints: list[Path], saved: Path, keep: int) -> list[Path]:
    """After `saved` is written: all but the newest `keep` of the checkpoints up to it. Newer
    ones (steps a run took before it was stopped and resumed from an older checkpoint, the
    newer one being unreadable) are left alone: pruning by count would delete the good
    checkpoints and keep the unreadable one, leaving nothing to resume from."""
    return checkpoints[:checkpoints.index(saved) + 1][:-keep]


def _cpu_copy(obj):
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {k: _cpu_copy(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_cpu_copy(v) for v in obj)
    return obj


class CheckpointWriter:
    """Saves checkpoints from a background thread. The training loop (and under DDP every
    other rank, which would wait for rank 0 in the next collective) only pays for a copy
    of the state in memory, never for a slow disk. One write at a time: a disk slower than
    --save-every makes the next save wait for the previous one."""

    def __init__(self, out_dir: str, keep: int):
        self.out_dir, self.keep = out_dir, keep
        self.thread, self.error = None, None
        finish_before_exit(self.wait)  # an error in the training loop lets a save in flight complete

    def checkpoint_at(self, step: int) -> Path:
        """The checkpoint of a run stopped after `step` (saved then, or resumed from if it
        took no step), which --resume continues from: as the user is told it."""
        return Path(self.out_dir) / CHECKPOINT

    def save(self, state: dict):
        self.wait()
        snapshot = _cpu_copy(state)  # training goes on changing the live tensors
        self.thread = threading.Thread(target=self._write, args=(snapshot,), name="checkpoint-writer")
        self.thread.start()

    def _write(self, state):
        try:
            save_checkpoint(state, self.out_dir, self.keep)
        except BaseException as e:  # re-raised in the training thread by wait()
            self.error = e

    def wait(self):
        """Block until the last checkpoint is on disk; raise if writing it failed."""
        if self.thread is not None:
            self.thread.join()
            self.thread = None
        if self.error is not None:
            error, self.error = self.error, None
            raise error


# config.json's one key beside the model's sizes: the fingerprint of the tokenizer.json the
# model's ids belong to (another run's tokenizer of the same size would pass every other check)
TOKENIZER_FINGERPRINT = "tokenizer_fingerprint"


def write_run_files(out_dir: str, tokenizer: Tokenizer, model: LlamaForPretraining):
    """tokenizer.json and config.json: what it takes to use model.pt later."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    atomic_save(tokenizer.to_str(), out / TOKENIZER)
    config = {**dataclasses.asdict(model.config), TOKENIZER_FINGERPRINT: data.tokenizer_fingerprint(tokenizer)}
    atomic_save(json.dumps(config, indent=2), out / CONFIG)


def config_fields(out: Path):
    """config.json as JSON (whatever it holds: read_config checks it), or one line."""
    text = corpus.read_text(out / CONFIG, "model config", 2**20)
    try:
        return json.loads(text)
    except (ValueError, RecursionError) as e:  # (RecursionError: "[[[[..." nested past the parser)
        raise UsageError(f"cannot read {out / CONFIG}: {first_line(e)}") from None


def read_config(out: Path) -> tuple[LlamaConfig, str | None]:
    """An output folder's config.json: the model's config and its tokenizer's fingerprint
    (None in a folder written before config.json recorded it)."""
    fields = config_fields(out)
    fingerprint = fields.pop(TOKENIZER_FINGERPRINT, None) if isinstance(fields, dict) else None
    try:
        return LlamaConfig(**fields), fingerprint
    except (ValueError, TypeError) as e:
        raise UsageError(f"cannot read {out / CONFIG}: {first_line(e)}") from None


def recorded_fingerprint(out: Path) -> str | None:
    """config.json's tokenizer fingerprint alone, for a run about to rewrite config.json: a
    folder from before the fingerprint, or a config.json unreadable, has none to check."""
    try:
        fields = config_fields(out)
    except UsageError:
        return None
    fingerprint = fields.get(TOKENIZER_FINGERPRINT) if isinstance(fields, dict) else None
    return fingerprint if isinstance(fingerprint, str) else None


def check_tokenizer(out: Path, tokenizer: Tokenizer, fingerprint: str | None):
    """That out/tokenizer.json is the one the run's model was trained with (config.json's
    fingerprint): another run's, or an edited one, gives the same text other ids, and the model
    would sample or train on them in silence. No fingerprint (an older folder): not checked."""
    if fingerprint is not None and fingerprint != data.tokenizer_fingerprint(tokenizer):
        raise UsageError(f"{out / TOKENIZER} is not the tokenizer its run was trained with (its fingerprint "
                         f"differs from the one in {CONFIG}): the tokenizer of another run, or an edited one? "
                         f"(To use it anyway, remove {TOKENIZER_FINGERPRINT} from {CONFIG}.)")


def shapes_of(state) -> dict:
    return {k: v.shape for k, v in state.items() if isinstance(v, torch.Tensor)} if isinstance(state, dict) else {}


def describe_shape(shape) -> str:
    return "missing" if shape is None else "(" + ", ".join(f"{n:,}" for n in shape) + ")"


def model_shapes(config: LlamaConfig) -> dict:
    """The name and shape of every weight of a model of this config, on the meta device
    (nothing allocated: a config may ask for a model no memory holds)."""
    with torch.device("meta"):
        return {name: t.shape for name, t in LlamaForPretraining(config).state_dict().items()}


def shape_difference(saved: dict, expected: dict) -> tuple[str, str, str] | None:
    """The first weight whose shape differs (or that one side lacks): (name, its shape in
    `saved`, in `expected`), or None when the two agree."""
    if saved == expected:
        return None
    name = next((k for k in expected if saved.get(k) != expected[k]), None) or next(k for k in saved
                                                                                 if k not in expected)
    return name, describe_shape(saved.get(name)), describe_shape(expected.get(name))


def init_source(path: str) -> tuple[Path, Path]:
    """--init-from PATH: (the output folder whose config.json and tokenizer.json go with the
    weights, the weights: a .pt file or a train_fsdp.py checkpoint folder). An output folder
    gives its model.pt, or else its newest checkpoint."""
    p = Path(path).expanduser()
    if p.is_dir() and (p / CONFIG).is_file():  # an output folder
        out = p
        # whatever is there (a FIFO, a folder, a dangling link): refused when read, never passed over
        newest = [p / name for name in (MODEL, CHECKPOINT) if os.path.lexists(p / name)] or sharded_checkpoints(p)[-1:]
        if not newest and (p / "model.safetensors").is_file():
            raise UsageError(f"--init-from {path} is a Hugging Face export (export_hf.py): give the output "
                             "folder it was exported from")
        if not newest:
            raise UsageError(f"--init-from {path} holds no {MODEL} and no checkpoint: nothing trained yet")
        weights = newest[0]
    elif p.is_file() or (p / ".metadata").is_file():
        out, weights = p.parent, p
    else:
        raise UsageError(f"--init-from {path}: not an output folder, a .pt file of one, or a train_fsdp.py "
                         "checkpoint folder")
    for needed in (CONFIG, TOKENIZER):
        if not (out / needed).is_file():
            raise UsageError(f"--init-from {path}: no {needed} beside the weights, in {out}")
    return out, weights


def weights_in(path: Path) -> dict:
    """The model's state_dict in a model.pt or checkpoint .pt file (memory-mapped)."""
    state = load_pt(path, "weights")
    if isinstance(state, dict) and {"model", "optimizer"} <= state.keys():  # a checkpoint
        state = state["model"]
    if not isinstance(state, dict) or not all(isinstance(t, torch.Tensor) for t in state.values()):
        raise UsageError(f"{path} holds no model weights")
    return state


def unusable_weight(state: dict) -> str | None:
    """The name of the first weight that is not finite floating point (NaN, inf, integers), or None.
    Only a plain tensor with values counts (a file may hold a sparse or a meta one)."""
    def usable(t) -> bool:
        return (isinstance(t, torch.Tensor) and t.layout == torch.strided and t.device.type != "meta"
                and t.is_floating_point() and bool(torch.isfinite(t).all()))
    return next((name for name, t in state.items() if not usable(t)), None)


def folder_weight_shapes(path: Path) -> dict:
    """The shape of every model weight in a sharded checkpoint folder (a .pt file's: shapes_of(weights_in))."""
    import sharded_checkpointing  # only for train_fsdp.py's folders
    return sharded_checkpointing.model_shapes({"path": str(path)})


def load_trained(out_dir: str) -> tuple[LlamaForPretraining, Tokenizer]:
    """The trained model (in eval mode, on the CPU) and its tokenizer, from an output folder:
    config.json, tokenizer.json and model.pt, or the newest checkpoint while the run is
    unfinished."""
    out = Path(out_dir)
    if not os.path.lexists(out / CONFIG):  # something there is read as a config.json must be (corpus.read_text)
        raise UsageError(f"{out} is not the output folder of a training run (no {CONFIG})")
    config, fingerprint = read_config(out)
    expected = model_shapes(config)
    ckpt = None
    if os.path.lexists(out / MODEL):  # whatever is there: a FIFO or a folder is refused, not passed over
        state = load_pt(out / MODEL, "weights")
        saved = shapes_of(state)
    elif sharded_checkpoints(out) and not (out / CHECKPOINT).is_file():  # an unfinished train_fsdp.py run
        import sharded_checkpointing  # here: DCP, which the other scripts' folders never need
        ckpt = sharded_checkpointing.load_latest_checkpoint(out)
        warn(f"no {MODEL} in {out} (the run has not finished): using {Path(ckpt['path']).name}, "
             f"step {ckpt['step']}, gathered from its shards")
        saved = sharded_checkpointing.model_shapes(ckpt)
    else:
        if not os.path.lexists(out / CHECKPOINT) and not numbered_checkpoints(out):
            raise UsageError(f"{out} holds no {MODEL} and no checkpoint: nothing trained yet")
        ckpt = load_latest_checkpoint(out)
        warn(f"no {MODEL} in {out} (the run has not finished): using {Path(ckpt['path']).name}, "
             f"step {ckpt['step']}")
        state = ckpt["model"]
        saved = shapes_of(state)
    if differ := shape_difference(saved, expected):  # before the model is allocated
        name, there, here = differ
        raise UsageError(f"the weights in {out} do not fit its {CONFIG}: {name} is {there} in the weights, "
                         f"{here} by {CONFIG}")
    model = LlamaForPretraining(config)
    if ckpt is not None and ckpt.get("sharded"):  # DCP reshards every tensor to this one process
        sharded_checkpointing.load_model(Path(ckpt["path"]), model)
    else:
        if name := unusable_weight(state):  # integers or NaN: load_state_dict would cast them in silence
            raise UsageError(f"the weights in {out} are not finite ({name} holds NaN, inf or integers): nothing to "
                             "sample or export from them")
        try:
            model.load_state_dict(state)
        except (RuntimeError, AttributeError) as e:
            raise UsageError(f"the weights in {out} do not fit its {CONFIG}: {first_line(e)}") from None
    if name := unusable_weight(dict(model.named_parameters())):  # what a diverged or damaged file holds
        raise UsageError(f"the weights in {out} are not finite ({name} holds NaN or inf): nothing to sample or "
                         "export from them")
    tokenizer = load_tokenizer(out / TOKENIZER)
    if tokenizer.get_vocab_size() != config.vocab_size:  # another run's: its ids would index other rows
        raise UsageError(f"{out / TOKENIZER} has {tokenizer.get_vocab_size():,} tokens, and the model "
                         f"{config.vocab_size:,} ({CONFIG}): the tokenizer of another run?")
    check_tokenizer(out, tokenizer, fingerprint)
    return model.eval(), tokenizer
