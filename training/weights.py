"""Trained weights, read from a run's folder: --init-from's source and its shapes checked
against the model before anything is allocated, and load_trained for the tools
(generate.py, export_hf.py). Nothing read is trusted: shapes, dtypes and finiteness are
checked, and a file that holds more than tensors is refused.
"""

import os
from pathlib import Path

import torch
from tokenizers import Tokenizer

from model import LlamaConfig, LlamaForPretraining
from training import files, pt_checkpoint, run_folder
from training.errors import UsageError, first_line, warn
from training.run_folder import CHECKPOINT, CONFIG, MODEL, TOKENIZER, numbered_checkpoints, sharded_checkpoints
from training.tokenized import load_tokenizer


def init_source(path: str) -> tuple[Path, Path]:
    """--init-from PATH: (the output folder whose config.json and tokenizer.json go with the
    weights, the weights: a .pt file or a train_fsdp.py checkpoint folder). An output folder
    gives its model.pt, or else its newest checkpoint."""
    p = Path(path).expanduser()
    if p.is_dir() and (p / CONFIG).is_file():  # an output folder
        out = p
        # whatever is there (a FIFO, a folder, a dangling link): refused when read, never passed over
        newest = [p / name for name in (MODEL, CHECKPOINT) if os.path.lexists(p / name)] or sharded_checkpoints(p)[-1:]
        if not newest and any(p.glob("model*.safetensors*")):  # a Hugging Face model's folder names its model_type
            raise UsageError(f"--init-from {path} holds safetensors, but its {CONFIG} is not a Hugging Face model's "
                             "(it names no model_type)")
        if not newest:
            raise UsageError(f"--init-from {path} holds no {MODEL} and no checkpoint: nothing trained yet")
        weights = newest[0]
    elif p.is_file() or (p / ".metadata").is_file():
        out, weights = p.parent, p
    else:
        hf = ": its safetensors have no config.json beside them" if p.is_dir() and any(p.glob("*.safetensors*")) else ""
        raise UsageError(f"--init-from {path}: not an output folder, a .pt file of one, a train_fsdp.py checkpoint "
                         f"folder, or a Hugging Face model's folder{hf}")
    for needed in (CONFIG, TOKENIZER):
        if not (out / needed).is_file():
            raise UsageError(f"--init-from {path}: no {needed} beside the weights, in {out}")
    return out, weights


def weights_in(path: Path) -> dict:
    """The model's state_dict in a model.pt or checkpoint .pt file (memory-mapped)."""
    state = files.load_pt(path, "weights")
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


def check_tie(state: dict | None, config: LlamaConfig, where: str) -> None:
    """A tied model's state holds one matrix under two names, the LM head's equal to the
    embedding's: a state whose two differ is an untied model's (or a config.json edited to tie
    it), and loading it would keep one of the two in silence."""
    if state is None or not config.tie_word_embeddings or not {"lm_head.weight", EMBEDDING} <= state.keys():
        return
    head, embedding = state["lm_head.weight"], state[EMBEDDING]
    if head is not embedding and not (head.shape == embedding.shape and torch.equal(head, embedding)):
        raise UsageError(f"{where}: the model ties its embeddings (tie_word_embeddings in config.json), but its "
                         "weights hold an LM head that differs from the embedding: an untied model's?")


EMBEDDING = "base_model.embed_tokens.weight"


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


def folder_weight_shapes(path: Path) -> dict:
    """The shape of every model weight in a sharded checkpoint folder (a .pt file's: shapes_of(weights_in))."""
    from training import sharded_checkpoint  # only for train_fsdp.py's folders
    return sharded_checkpoint.model_shapes({"path": str(path)})


def load_trained(out_dir: str) -> tuple[LlamaForPretraining, Tokenizer]:
    """The trained model (in eval mode, on the CPU) and its tokenizer, from an output folder:
    config.json, tokenizer.json and model.pt, or the newest checkpoint while the run is
    unfinished."""
    out = Path(out_dir)
    if not os.path.lexists(out / CONFIG):  # something there is read as a config.json must be (corpus.read_text)
        raise UsageError(f"{out} is not the output folder of a training run (no {CONFIG})")
    config, fingerprint = run_folder.read_config(out)
    expected = model_shapes(config)
    ckpt = None
    if os.path.lexists(out / MODEL):  # whatever is there: a FIFO or a folder is refused, not passed over
        state = files.load_pt(out / MODEL, "weights")
        saved = shapes_of(state)
    elif sharded_checkpoints(out) and not (out / CHECKPOINT).is_file():  # an unfinished train_fsdp.py run
        from training import sharded_checkpoint  # here: DCP, which the other scripts' folders never need
        ckpt = sharded_checkpoint.load_latest_checkpoint(out)
        warn(f"no {MODEL} in {out} (the run has not finished): using {Path(ckpt['path']).name}, "
             f"step {ckpt['step']}, gathered from its shards")
        saved = sharded_checkpoint.model_shapes(ckpt)
    else:
        if not os.path.lexists(out / CHECKPOINT) and not numbered_checkpoints(out):
            raise UsageError(f"{out} holds no {MODEL} and no checkpoint: nothing trained yet")
        ckpt = pt_checkpoint.load_latest_checkpoint(out)
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
        sharded_checkpoint.load_model(Path(ckpt["path"]), model)
    else:
        check_tie(state, config, f"the weights in {out}")
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
    tokenizer = load_tokenizer(out / TOKENIZER, config)  # as many tokens as the embedding has rows
    run_folder.check_tokenizer(out, tokenizer, fingerprint)
    return model.eval(), tokenizer
