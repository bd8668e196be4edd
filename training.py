"""What the three scripts share: data preparation, model building, optimizer and schedule,
resume and evaluation. The flags live in config.py (training.parse_args is config's), and
what a run logs in metrics.py. No DataParallel, DDP or FSDP call is made here: the scripts
hold those, the parts that differ. (A few helpers work on whatever they are given, an FSDP
model's sharded weights included: init_weights, weights_finite, evaluate.)
"""

import dataclasses
import glob
import inspect
import math
import os
from pathlib import Path

import torch
from tokenizers import Tokenizer

import checkpointing
import corpus
import data
import packing
from checkpointing import METRICS, TOKENIZER
# the flags live in config.py; the scripts (and the tools) reach them through this module
from config import TRAINING_PRESETS, ArgumentParser, TrainConfig, micro_batch_size, parse_args  # noqa: F401
from errors import UsageError, first_line
from launcher import is_rank0, restart_count, warn
from metrics import read_metrics
from model import PRESETS, LlamaConfig, LlamaForPretraining


# ---------------------------------------------------------------------------------------
# Data: four stages, so the DDP script can run each on the right ranks


class OneProcess:
    """How a single process runs the stages of prepare_data: each one, once, here.
    (train_ddp.py passes launcher.InTurns, which runs them across ranks.)"""

    def everywhere(self, fn):
        return fn()

    local_rank0_first = from_rank0 = everywhere


def prepare_data(cfg: TrainConfig, turns=OneProcess(), sharded: bool = False, model_fits=None):
    """The checkpoint to resume from (None for a new run), the tokenizer, and the training
    and held-out datasets. Tokenized once: `datasets` caches the result on disk. sharded:
    the run's checkpoints are train_fsdp.py's. model_fits (a memory.Check): called with the
    vocabulary size, as soon as it is known."""
    resuming = turns.everywhere(lambda: checkpointing.resuming(cfg.out_dir, cfg.resume))  # refuses to overwrite a run
    ckpt = turns.everywhere(lambda: load_run(cfg.out_dir, sharded)) if resuming else None
    train_text, val_text, fingerprint = load_text(cfg, ckpt, turns)
    # one tokenizer for the whole job: rank 0 trains (or loads) it and sends it to all
    tokenizer = Tokenizer.from_str(turns.from_rank0(lambda: get_tokenizer(cfg, train_text, resuming).to_str()))
    if model_fits:  # a model too big for the device is refused before tokenizing, and before anything is written
        turns.everywhere(lambda: model_fits(tokenizer.get_vocab_size()))
    if cfg.init_from:  # so is a model that --init-from's weights do not fit
        turns.everywhere(lambda: check_init_from(cfg, tokenizer.get_vocab_size()))
    train_ds, val_ds = turns.local_rank0_first(lambda: make_datasets(cfg, tokenizer, train_text, val_text, fingerprint))
    turns.everywhere(lambda: claim_out_dir(cfg, ckpt))  # only now: a refused run creates nothing
    return ckpt, tokenizer, train_ds, val_ds


def claim_out_dir(cfg: TrainConfig, ckpt: dict | None):
    """Rank 0 locks --out-dir for the whole run, then checks that nothing changed there while
    the data was prepared: no other run has saved into it since our first look."""
    if not is_rank0():
        return
    checkpointing.lock_out_dir(cfg.out_dir)
    checkpointing.resuming(cfg.out_dir, cfg.resume)  # a new run still finds no run there
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


def get_tokenizer(cfg: TrainConfig, train_text, resuming: bool) -> Tokenizer:
    """The run's own tokenizer on resume, else --tokenizer, else a BPE trained on train_text."""
    if resuming:
        out = Path(cfg.out_dir)
        tokenizer = data.load_tokenizer(out / TOKENIZER)
        checkpointing.check_tokenizer(out, tokenizer, checkpointing.recorded_fingerprint(out))  # the run's own
        if cfg.tokenizer and data.load_tokenizer(cfg.tokenizer).to_str() != tokenizer.to_str():
            raise UsageError(f"--tokenizer {cfg.tokenizer} differs from the run's {TOKENIZER}")
        return tokenizer
    if cfg.tokenizer:
        return data.load_tokenizer(cfg.tokenizer)
    return data.train_tokenizer(train_text, cfg.vocab_size)


def make_datasets(cfg: TrainConfig, tokenizer: Tokenizer, train_text, val_text, fingerprint: dict | None = None):
    """The training and held-out datasets: every document's windows, one a row, or with --pack
    several a row (the held-out ones too, so that evaluation costs what training does)."""
    pad_id = tokenizer.token_to_id(data.PAD)

    def dataset(texts, **facts):
        windows = data.tokenize(texts, tokenizer, cfg.seq_len)
        if cfg.pack:
            return packing.PackedSequenceDataset(windows, cfg.seq_len, pad_id, documents=len(texts), **facts,
                                                 packing=packing.pack(windows, cfg.seq_len, cfg.seed))
        return data.PaddedSequenceDataset(windows, cfg.seq_len, pad_id, documents=len(texts), **facts)
    train = dataset(train_text, corpus=fingerprint)
    val = dataset(val_text, text_bytes=corpus.text_bytes(val_text))
    if len(train) < cfg.batch_size:  # not one step's worth
        raise UsageError(f"dataset has {len(train)} training rows of --seq-len {cfg.seq_len} (from "
                         f"{len(train_text)} documents), fewer than one --batch-size of {cfg.batch_size}")
    return train, val


def bits_per_byte(loss_sum: torch.Tensor, val_ds: data.PaddedSequenceDataset) -> float:
    """The held-out loss in bits per UTF-8 byte of its documents' text: the summed loss over
    every token (in nats: / ln 2 for bits), over the bytes they encode. Unlike the loss per
    token, it does not depend on the tokenizer."""
    return loss_sum.item() / math.log(2) / val_ds.text_bytes


def val_loader(val_ds, rank: int, world_size: int, batch_size: int, same_length: bool = False):
    """Every rank takes every world_size-th held-out sequence, without DistributedSampler's
    padding (which repeats samples and would bias the loss); the sums are then all-reduced.
    same_length: ranks with one sequence fewer get a sequence of padding, whose targets are
    all ignored, so that every rank runs the same number of forwards (FSDP needs that)."""
    indices = list(range(rank, len(val_ds), world_size))
    if same_length and len(indices) < -(-len(val_ds) // world_size):
        indices.append(-1)  # -1: the padding sequence
    shard = [val_ds[i] if i >= 0 else val_ds.padding_row() for i in indices] if same_length else \
        torch.utils.data.Subset(val_ds, indices)
    return torch.utils.data.DataLoader(shard, batch_size=batch_size)


# ---------------------------------------------------------------------------------------
# Model, optimizer, schedule


def build_model(cfg: TrainConfig, vocab_size: int, dtype: torch.dtype, device="cpu") -> LlamaForPretraining:
    """The model with its initial weights on `device`; on "meta", shapes only (FSDP shards it
    first, then calls init_weights)."""
    model_config = LlamaConfig(vocab_size=vocab_size, trained_seq_len=cfg.seq_len, **PRESETS[cfg.model])
    torch.manual_seed(cfg.seed)  # nothing draws from it after initialization; any future dropout would
    with torch.device("meta"):  # shapes only: no memory, no random draws
        model = LlamaForPretraining(model_config)
    model.compute_dtype = dtype  # matmuls in dtype (autocast inside forward); weights stay fp32
    if cfg.activation_checkpointing:
        model.enable_activation_checkpointing()  # before compile and FSDP wrap the layers
    if device != "meta":
        model.to_empty(device=device)
        init_weights(model, cfg)
    return model


@torch.no_grad()
def init_weights(model: LlamaForPretraining, cfg: TrainConfig):
    """The initial weights, into a model given memory but no values (to_empty): drawn from
    --seed (the same in every process and script: model.initial_weights), or --init-from's.
    An FSDP-sharded parameter takes this rank's shard of each whole tensor: no rank holds
    more than one whole tensor at a time (a file's are memory-mapped)."""
    from torch.distributed.tensor import DTensor, distribute_tensor
    # every rank holds the same whole value: from torch 2.7 each keeps its part with no
    # communication (src_data_rank=None); torch 2.6 scatters rank 0's, the same values
    local = {"src_data_rank": None} if "src_data_rank" in inspect.signature(distribute_tensor).parameters else {}
    if cfg.init_from:  # the weights themselves (config.py resolved a folder to its newest)
        weights = Path(cfg.init_from)
        if weights.is_dir():  # a train_fsdp.py checkpoint: DCP reads each rank's part
            import sharded_checkpointing
            sharded_checkpointing.load_model(weights, model)
            if not weights_finite(model):  # a .pt file's values were checked before anything was written
                raise UsageError(f"--init-from {cfg.init_from}: its weights are not all finite (NaN or inf): no run "
                                 "can start from these weights")
            values = ()
        else:
            state = checkpointing.weights_in(weights)
            values = ((param, state[name]) for name, param in model.named_parameters())
    else:
        values = model.initial_weights(cfg.seed)
    for param, value in values:
        if isinstance(param, DTensor):  # FSDP: this rank's part of the whole value
            value = distribute_tensor(value, param.device_mesh, param.placements, **local).to_local()
            param = param.to_local()
        param.copy_(value)
    model.base_model.rotary_emb.reset_tables()  # buffers too: to_empty left them uninitialized


def check_init_from(cfg: TrainConfig, vocab_size: int):
    """--init-from's weights must have the shapes of the model this run builds: a clear line
    before anything is allocated or written, not a failed copy."""
    path = Path(cfg.init_from)
    state = None if path.is_dir() else checkpointing.weights_in(path)  # a .pt file: read once, memory-mapped
    saved = checkpointing.folder_weight_shapes(path) if state is None else checkpointing.shapes_of(state)
    expected = checkpointing.model_shapes(LlamaConfig(vocab_size=vocab_size, **PRESETS[cfg.model]))
    if differ := checkpointing.shape_difference(saved, expected):
        name, there, here = differ
        raise UsageError(f"--init-from {cfg.init_from}: its weights do not fit --model {cfg.model} with its "
                         f"{vocab_size:,}-token vocabulary: {name} is {there} there, {here} here")
    if state is not None and (name := checkpointing.unusable_weight(state)):  # one pass over the file's values
        raise UsageError(f"--init-from {cfg.init_from}: {name} is not finite floating point (NaN, inf or "
                         "integers): no run can start from these weights")


def nvidia_gpus() -> list[str]:
    """The NVIDIA GPUs this machine has, whether or not torch can use them: the device files
    the driver makes, one per GPU (/dev/nvidia0, /dev/nvidia1, ...)."""
    return sorted(glob.glob("/dev/nvidia[0-9]*"))


def use_cuda(cfg: TrainConfig) -> bool:
    """Whether to train on CUDA: where torch sees a GPU, unless --device cpu. Where torch sees
    none on a machine that has NVIDIA GPUs (a CPU build of torch, or a CUDA build newer than
    the driver), a job meant for 8 GPUs would otherwise train on the CPU without a word."""
    if cfg.device == "cpu":
        return False
    if torch.cuda.is_available():
        return True
    gpus = nvidia_gpus()
    if gpus or cfg.device == "cuda":
        built = (f"a CUDA {torch.version.cuda} build, which this driver may be too old for" if torch.version.cuda
                 else "a CPU-only build")
        hidden = os.environ.get("CUDA_VISIBLE_DEVICES")
        hidden = f"; CUDA_VISIBLE_DEVICES={hidden!r} hides GPUs" if hidden is not None else ""
        has = f"this machine has NVIDIA GPUs ({', '.join(gpus[:2])}{', ...' if len(gpus) > 2 else ''})" if gpus \
            else "--device cuda"
        raise UsageError(f"{has} but torch {torch.__version__} sees none: it is {built}{hidden}. Install the "
                         "torch build for your driver (https://pytorch.org/get-started/locally/), or pass "
                         "--device cpu to train on the CPU")
    return False


def compute_dtype(choice: str, device: torch.device) -> torch.dtype:
    """The dtype matmuls run in. bf16 pays where the hardware has bf16 matrix units: GPUs
    from Ampere on (compute capability 8.0), and CPUs with AMX (Xeon Sapphire Rapids and
    later, where a bf16 matmul runs several times faster than fp32). Elsewhere auto keeps
    fp32. Older GPUs (V100, T4) only emulate bf16, slowly: there --dtype bf16 is refused."""
    if device.type == "cuda":
        # fp32 matmuls (all of --dtype fp32's, and the few a bf16 step keeps in fp32) on TF32
        # tensor cores: inputs rounded to 10 mantissa bits, products summed in fp32, several
        # times faster than full fp32. Weights and optimizer state stay fp32 all the same.
        torch.set_float32_matmul_precision("high")
    if choice == "fp32":
        return torch.float32
    if device.type == "cuda":
        # not torch.cuda.is_bf16_supported(): by default it counts emulation as support
        if torch.cuda.get_device_capability(device) >= (8, 0):
            return torch.bfloat16
        if choice == "bf16":
            name = torch.cuda.get_device_name(device)
            raise UsageError(f"--dtype bf16: {name} has no native bf16 (compute capability 8.0 or newer "
                             "needed); use --dtype fp32")
        return torch.float32
    if choice == "bf16" or torch.cpu._is_amx_tile_supported():
        return torch.bfloat16
    return torch.float32


def make_optimizer(model: torch.nn.Module, cfg: TrainConfig, total_steps: int):
    # Decay matrices and embeddings; RMSNorm gains (1-D) stay undecayed, as usual for Llama.
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=cfg.lr, betas=(0.9, 0.99), eps=1e-8,
        fused=decay[0].is_cuda)  # one kernel for the whole update on GPUs
    warmup = cfg.warmup_steps

    def lr_factor(step):  # multiplies the peak LR
        if step < warmup:
            return 0.1 + 0.9 * step / warmup
        progress = (step - warmup) / max(1, total_steps - warmup)
        return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))

    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor)


def total_steps(cfg: TrainConfig, steps_per_epoch: int) -> int:
    all_epochs = cfg.epochs * steps_per_epoch
    total = min(cfg.max_steps, all_epochs) if cfg.max_steps else all_epochs
    if cfg.warmup_steps >= total:
        warn(f"--warmup-steps {cfg.warmup_steps} is not shorter than the run ({total} steps): the learning rate "
             "is still warming up when the run ends, and never decays")
    return total


# ---------------------------------------------------------------------------------------
# Resuming


def resume(ckpt: dict | None, cfg: TrainConfig, model, optimizer, scheduler, steps_per_epoch: int) -> int:
    """Load a checkpoint into freshly built objects (on every rank) and return its step; 0
    for a new run. A resumed run must be the same run: same model, data, global batch and
    schedule (the flags marked same_on_resume). Once restored, ckpt is emptied, so that no
    rank keeps a second copy of the weights and optimizer state for the whole run."""
    if ckpt is None:
        return 0
    all_epochs = cfg.epochs * steps_per_epoch
    if ckpt["step"] > (last := min(cfg.max_steps, all_epochs) if cfg.max_steps else all_epochs):
        raise UsageError(f"{ckpt['path']} is at step {ckpt['step']}, past this run's last step ({last}): the "
                         "checkpoint is damaged; move it away to resume from the one before it")
    for f in dataclasses.fields(cfg):  # the flags first: they name what changed in the user's words
        was, now = ckpt["train_config"].get(f.name), getattr(cfg, f.name)
        if f.name == "vocab_size" and now is None:  # not given: the run's own tokenizer.json decides it
            cfg.vocab_size = was  # and its checkpoints keep recording what the run was started with
            continue
        if f.metadata["same_on_resume"] and was != now:
            raise UsageError(f"--{f.name.replace('_', '-')} was {was!r} in the checkpoint's run, now {now!r}: "
                             "resume with the same value")
    ours = dataclasses.asdict(model.config)
    for key, value in ckpt["model_config"].items():
        if ours.get(key) != value:
            raise UsageError(f"checkpoint's model has {key}={value}, this run's has {ours.get(key)}")
    if ckpt.get("framing") not in (data.FRAMING, data.PACKED_FRAMING):  # each document's first seq_len tokens
        raise UsageError(f"{Path(ckpt['path']).name} was trained on documents clipped to one row each (an earlier "
                         "version of this trainer); this one trains on every token, in windows: start a new run")
    if ckpt["framing"] != data.framing(cfg.pack):  # other rows: its data position would point elsewhere
        packed = ckpt["framing"] == data.PACKED_FRAMING
        raise UsageError(f"{Path(ckpt['path']).name} was trained {'with' if packed else 'without'} --pack "
                         f"(its rows hold {'several windows' if packed else 'one window'} each): resume "
                         f"{'with' if packed else 'without'} --pack")
    if ckpt["steps_per_epoch"] != steps_per_epoch:
        raise UsageError(f"the dataset changed since the checkpoint ({steps_per_epoch} steps per epoch, "
                         f"was {ckpt['steps_per_epoch']})")
    if not ckpt.get("sharded") and (name := checkpointing.unusable_weight(ckpt["model"])):  # int: cast in silence
        raise UsageError(f"{ckpt['path']}: {name} is not finite floating point (NaN, inf or integers): the "
                         "checkpoint is damaged; move it away to resume from the one before it")
    try:  # what the checks above cannot see (a weight's shape, a moment's, a generator state) torch refuses
        if ckpt.get("sharded"):  # train_fsdp.py's: every rank reads the shards it needs, resharding them
            import sharded_checkpointing  # here: DCP takes 0.7 s to import, which DP and DDP never need
            sharded_checkpointing.restore(ckpt, model, optimizer)
            step = checkpointing.restore_run_state(ckpt, scheduler)
        else:
            step = checkpointing.restore(ckpt, model, optimizer, scheduler)
    except (RuntimeError, ValueError, TypeError, KeyError, IndexError, AttributeError) as e:
        raise UsageError(f"{ckpt['path']} cannot be restored ({first_line(e)}): the checkpoint is damaged; move it "
                         "away to resume from the one before it") from None
    lrs = [group["lr"] for group in optimizer.param_groups] + list(scheduler.base_lrs)
    if not weights_finite(model, optimizer) or not all(isinstance(lr, float) and math.isfinite(lr) for lr in lrs):
        # a run saves only finite weights, moments and rates: these were damaged since
        raise UsageError(f"{ckpt['path']} holds weights or optimizer state that are not finite: the checkpoint is "
                         "damaged; move it away to resume from the one before it")
    if is_rank0():
        print(f"resumed from {ckpt['path']} at step {step} (restart {restart_count()})")
    ckpt.clear()  # all of it is in the model, optimizer and scheduler now: let the loaded file go
    return step


# ---------------------------------------------------------------------------------------
# Evaluation, and the checks on what is logged and saved


@torch.no_grad()
def evaluate(model, loader, device) -> torch.Tensor:
    """Return this process's [sum of token losses, number of targets] over `loader`."""
    model.eval()
    totals = torch.zeros(2, dtype=torch.float64, device=device)
    for batch in loader:
        loss_sum, n_tokens = model(*on_device(batch, device))
        totals += torch.stack([loss_sum.sum(), n_tokens.sum()])
    model.train()
    return totals


def next_micro_batches(batches, grad_accum: int, device: torch.device) -> list:
    """The grad_accum micro-batches of one optimizer step, on the device (see on_device)."""
    return [on_device(next(batches), device) for _ in range(grad_accum)]


def on_device(batch, device: torch.device) -> tuple:
    """(inputs, targets, position_ids) of a batch, on the device. position_ids: each token's
    position in its window, for rows that hold several (--pack); else None."""
    x, y, *packed = batch
    position_ids = packed[0].to(device, non_blocking=True) if packed else None
    return x.to(device, non_blocking=True), y.to(device, non_blocking=True), position_ids


def weights_finite(model: torch.nn.Module, optimizer=None) -> bool:
    """Whether every weight is finite (and, given the optimizer, every number of its state:
    AdamW's moments). One reduction and one host sync for all, not one per tensor; under FSDP
    each rank checks its own shards (to_local) and the ranks agree on the answer (so every
    rank must call it)."""
    tensors = list(model.parameters())
    if optimizer is not None:
        tensors += [t for state in optimizer.state.values() for t in state.values()
                    if isinstance(t, torch.Tensor) and t.is_floating_point()]
    sharded = any(hasattr(t, "to_local") for t in tensors)  # FSDP's DTensors
    finite = torch.stack([torch.isfinite(t.to_local() if hasattr(t, "to_local") else t).all() for t in tensors]).all()
    if sharded:
        finite = finite.to(torch.int32)
        torch.distributed.all_reduce(finite, op=torch.distributed.ReduceOp.MIN)
    return bool(finite.item())


def stop_if_diverged(step: int, cfg: TrainConfig, loss: float | None = None, grad_norm: float | None = None,
                     model: torch.nn.Module | None = None):
    """Raise if the logged loss or gradient norm, or any weight about to be saved, is not
    finite: nothing non-finite reaches metrics.jsonl or a checkpoint, and the older
    checkpoints stay good. And if the gradient norm is exactly 0: AdamW would do nothing."""
    weights_bad = model is not None and not weights_finite(model)
    logged = {"loss": loss, "gradient norm": grad_norm}
    bad = [f"{name} is {value}" for name, value in logged.items() if value is not None and not math.isfinite(value)]
    if weights_bad or bad:
        what = "weights are not finite" if weights_bad else bad[0]
        raise UsageError(f"training diverged: the {what} at step {step}. Start again with a lower --lr "
                         f"(was {cfg.lr}) or a longer --warmup-steps (was {cfg.warmup_steps})")
    if grad_norm == 0.0:  # no real target has a gradient of exactly 0: the gradients never reached the weights
        raise UsageError(f"every gradient is exactly 0 at step {step}: the model does not train. A compiler bug "
                         f"does this (torch 2.11 with --compile, pytorch/pytorch#180642): run without --compile, "
                         f"or with another torch (this is {torch.__version__})")


def load_run(out_dir: str, sharded: bool = False) -> dict:
    """What a resumed run continues: its newest readable checkpoint, and a metrics.jsonl
    that can be read (the run appends to it). sharded: train_fsdp.py's checkpoints."""
    read_metrics(Path(out_dir) / METRICS)
    out = Path(out_dir)
    has_sharded = bool(checkpointing.sharded_checkpoints(out))
    if sharded and not has_sharded:
        raise UsageError(f"{out} holds checkpoints of train_dp.py/train_ddp.py, not sharded ones: continue that "
                         "run with train_ddp.py (or train_dp.py)")
    if not sharded and has_sharded:
        raise UsageError(f"{out} holds sharded checkpoints of train_fsdp.py: continue that run with train_fsdp.py")
    if sharded:
        import sharded_checkpointing  # as in resume(): only train_fsdp.py needs DCP
        return sharded_checkpointing.load_latest_checkpoint(out)
    return checkpointing.load_latest_checkpoint(out)
