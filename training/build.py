"""What a run trains, built from the flags: the model with its first weights (drawn from
--seed, or --init-from's), and AdamW with the article's schedule. No DataParallel, DDP or
FSDP call is made here: the scripts hold those. init_weights works on whatever it is given,
an FSDP model's sharded weights included.
"""

import math
from pathlib import Path

import torch

from model import LlamaForPretraining
from training import config, hf_import, stopping, weights
from training.config import TrainConfig
from training.errors import UsageError


def model(cfg: TrainConfig, vocab_size: int, dtype: torch.dtype, device="cpu") -> LlamaForPretraining:
    """The model with its initial weights on `device`; on "meta", shapes only (FSDP shards it
    first, then calls init_weights)."""
    model_config = config.model_config(cfg, vocab_size)  # the --model preset's, or an imported model's
    torch.manual_seed(cfg.seed)  # nothing draws from it after initialization; any future dropout would
    with torch.device("meta"):  # shapes only: no memory, no random draws
        model = LlamaForPretraining(model_config)
    model.compute_dtype = dtype  # matmuls in dtype (autocast inside forward); weights stay fp32
    model.packed_attention = cfg.packed_attention or "flex"  # --pack's kernel on CUDA
    if cfg.activation_checkpointing:
        model.enable_activation_checkpointing()  # before compile and FSDP wrap the layers
    if device != "meta":
        model.to_empty(device=device)
        model.tie_weights()  # to_empty untied them
        init_weights(model, cfg)
    return model


@torch.no_grad()
def init_weights(model: LlamaForPretraining, cfg: TrainConfig):
    """The initial weights, into a model given memory but no values (to_empty): drawn from
    --seed (the same in every process and script: model.initial_weights), or --init-from's.
    An FSDP-sharded parameter takes this rank's shard of each whole tensor: no rank holds
    more than one whole tensor at a time (a file's are memory-mapped)."""
    from torch.distributed.tensor import DTensor, distribute_tensor
    if cfg.init_from:  # the weights themselves (config.py resolved a folder to its newest)
        path = Path(cfg.init_from)
        if hf_import.is_hf_folder(path):  # a Hugging Face model: each parameter reads its own part of the files
            hf_import.load_into(model, path)
            values = ()
        elif path.is_dir():  # a train_fsdp.py checkpoint: DCP reads each rank's part
            from training import sharded_checkpoint  # only for train_fsdp.py's folders
            sharded_checkpoint.load_model(path, model)
            values = ()
        else:
            state = weights.weights_in(path)
            values = ((param, state[name]) for name, param in model.named_parameters())
    else:
        values = model.initial_weights(cfg.seed)
    for param, value in values:
        if isinstance(param, DTensor):  # FSDP: this rank's part of the whole value
            # every rank holds the same whole value, so each keeps its part with no communication
            # (src_data_rank=None; the default would scatter rank 0's, the same values)
            value = distribute_tensor(value, param.device_mesh, param.placements, src_data_rank=None).to_local()
            param = param.to_local()
        param.copy_(value)
    if cfg.init_from and Path(cfg.init_from).is_dir() and not stopping.weights_finite(model):
        # (a .pt file's values were checked before anything was written; these, each rank its part, once read)
        raise UsageError(f"--init-from {cfg.init_from}: its weights are not all finite (NaN or inf): no run can "
                         "start from these weights")
    model.base_model.rotary_emb.reset_tables()  # buffers too: to_empty left them uninitialized


def check_init_from(cfg: TrainConfig, vocab_size: int):
    """--init-from's weights must have the shapes of the model this run builds: a clear line
    before anything is allocated or written, not a failed copy."""
    path = Path(cfg.init_from)
    if hf_import.is_hf_folder(path):  # a Hugging Face model's files: checked with the flags (config.parse_args)
        return
    model_config = config.model_config(cfg, vocab_size)
    expected = weights.model_shapes(model_config)
    state = None if path.is_dir() else weights.weights_in(path)  # a .pt file: read once, memory-mapped
    saved = weights.folder_weight_shapes(path) if state is None else weights.shapes_of(state)
    weights.check_tie(state, model_config, f"--init-from {cfg.init_from}")
    if differ := weights.shape_difference(saved, expected):
        name, there, here = differ
        raise UsageError(f"--init-from {cfg.init_from}: its weights do not fit --model {cfg.model} with its "
                         f"{vocab_size:,}-token vocabulary: {name} is {there} there, {here} here")
    if state is not None and (name := weights.unusable_weight(state)):  # one pass over the file's values
        raise UsageError(f"--init-from {cfg.init_from}: {name} is not finite floating point (NaN, inf or "
                         "integers): no run can start from these weights")


class AdamW(torch.optim.AdamW):
    """torch's AdamW, less one question on a CPU. A CUDA build's step() first asks the current
    CUDA stream whether it is capturing a graph (_accelerator_graph_capture_health_check). torch
    2.13 and 2.14 ask through torch.accelerator.current_stream(): in a --device cpu run on a
    machine with GPUs, that opens a CUDA context on GPU 0 in every process (0.3-0.5 GiB each) at
    the first step; 2.11 and 2.12 ask torch.cuda.is_current_stream_capturing(), which starts
    CUDA's runtime in the process. Tensors on a CPU are never captured: the question is asked
    only where the weights are on a GPU."""

    def _accelerator_graph_capture_health_check(self):
        if self.param_groups[0]["params"][0].device.type != "cpu":
            super()._accelerator_graph_capture_health_check()


def optimizer(model: torch.nn.Module, cfg: TrainConfig, total_steps: int):
    # Decay matrices and embeddings; RMSNorm gains (1-D) stay undecayed, as usual for Llama.
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    optimizer = AdamW(
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
