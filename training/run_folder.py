"""A run's output folder: the names of its files, its checkpoints listed by step, the lock
that keeps a second run out, and the files beside the weights (tokenizer.json,
config.json) that it takes to use them later. Never overwrite a run: checked here, before
anything is written.
"""

import dataclasses
import fcntl
import json
import os
import re
import shutil
from pathlib import Path

from tokenizers import Tokenizer

import data
from model import LlamaConfig, LlamaForPretraining
from training import corpus, files, model_config
from training.errors import UsageError, first_line

CHECKPOINT, MODEL, TOKENIZER, CONFIG, METRICS = (
    "checkpoint.pt", "model.pt", "tokenizer.json", "config.json", "metrics.jsonl")
TENSORBOARD, WANDB_RUN = "tensorboard", "wandb-run.txt"  # --tensorboard's event files, --wandb's run id
PROFILE = "profile"  # --profile's traces (profiling.py)
# a trace (or memory snapshot) in OUT/profile while it is written: .<its name>.partial, and kineto's own
# .partial.tmp beside it (profiling.py). Hidden names no user's file has: a run deletes the ones a killed session left.
PARTIAL_TRACE = re.compile(r"\.rank\d+\.steps\d+-\d+\.(pt\.trace\.json|memory\.pickle)\.partial(\.tmp)?")
RUN_FILES = (CHECKPOINT, MODEL, TOKENIZER, CONFIG, METRICS, TENSORBOARD, WANDB_RUN, PROFILE)  # + checkpoint-<step>.pt
FOLDERS = (TENSORBOARD, PROFILE)  # of RUN_FILES, the folders
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
    """The checkpoint-<step>/ folders train_fsdp.py wrote (sharded_checkpoint.py), oldest first."""
    return _by_step((p for p in out.glob("checkpoint-*") if p.is_dir()), NUMBERED_DIR)


_LOCKS = []  # open descriptors of the output folders this process holds, until it exits


def _forget_locks():
    """In a child forked by this process (a DataLoader worker, a tokenizing process): close its
    copies of the lock descriptors. The lock stays the parent's (an flock belongs to the open
    file, which the parent still holds), but a child that outlives a parent killed with kill -9
    (a worker notices within seconds) no longer keeps the folder locked against the resume."""
    for fd in _LOCKS:
        os.close(fd)
    _LOCKS.clear()


os.register_at_fork(after_in_child=_forget_locks)


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


def partial_trace(final: Path) -> Path:
    """The name profiling.py writes `final` under before renaming it (PARTIAL_TRACE's form)."""
    return final.with_name(f".{final.name}.partial")


def remove_temp_files(out: Path):
    """Delete the temp files a crash (or a full disk) left behind in a run's folder: only the
    names atomic_save gives and the partial traces in OUT/profile (regular files alone: a
    folder or a link there is the user's), and only while this run holds the folder's lock."""
    ours = [out / (name + ".tmp") for name in RUN_FILES]
    ours += [p for p in out.glob("checkpoint-*.tmp") if NUMBERED.fullmatch(p.name[:-len(".tmp")])
             or NUMBERED_DIR.fullmatch(p.name[:-len(".tmp")])]
    profile = out / PROFILE
    if profile.is_dir() and os.access(profile, os.R_OK | os.X_OK):
        ours += [p for p in profile.iterdir() if PARTIAL_TRACE.fullmatch(p.name) and p.is_file() and not p.is_symlink()]
    for tmp in ours:
        if tmp.is_dir() and not tmp.is_symlink():
            shutil.rmtree(tmp)  # a sharded checkpoint that not every rank finished
        else:
            tmp.unlink(missing_ok=True)


# config.json's one key beside the model's sizes: the fingerprint of the tokenizer.json the
# model's ids belong to (another run's tokenizer of the same size would pass every other check)
TOKENIZER_FINGERPRINT = "tokenizer_fingerprint"


def write_run_files(out_dir: str, tokenizer: Tokenizer, model: LlamaForPretraining):
    """tokenizer.json and config.json: what it takes to use model.pt later."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    files.atomic_save(tokenizer.to_str(), out / TOKENIZER)
    config = {**dataclasses.asdict(model.config), TOKENIZER_FINGERPRINT: data.tokenizer_fingerprint(tokenizer)}
    files.atomic_save(json.dumps(config, indent=2), out / CONFIG)


def save_model(out_dir: str, state: dict):
    """model.pt: the whole model's weights, what tools/generate.py and tools/export_hf.py read."""
    files.atomic_save(state, Path(out_dir) / MODEL)


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
        return model_config.checked(fields), fingerprint
    except (ValueError, TypeError) as e:
        raise UsageError(f"cannot read {out / CONFIG}: {first_line(e)}") from None


def imported_architecture(out: Path) -> dict | None:
    """An imported model's architecture (config.architecture), from its run's config.json: a model
    that names its own special tokens was imported. None for a --model preset's run, or where
    config.json cannot be read (the resume then says what is wrong)."""
    try:
        config, _ = read_config(out) if (out / CONFIG).is_file() else (None, None)
    except UsageError:
        return None
    if config is None or not config.own_special_tokens:
        return None
    return {**dataclasses.asdict(config), "trained_seq_len": None}


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
