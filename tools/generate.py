"""Sample text from a trained model.

    python tools/generate.py out --prompt "def main(" --max-new-tokens 200
    python tools/generate.py out --prompt "import os" --temperature 0      # greedy: always the same text

Reads config.json, tokenizer.json and model.pt from the output folder of any of the three
training scripts (or its newest checkpoint while the run is unfinished). The prompt is framed
the way training framed documents, [BOT] + text (an imported model: its own begin token);
generation ends at [EOT] (its own end token) or after
--max-new-tokens, and the text is printed without special tokens.

Each step feeds only the newest token: the keys and values of every earlier position wait
in a KV cache, so a token costs the same at position 1000 as at position 10.
"""

import argparse
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root, from any folder
from data import special_ids, text_only  # noqa: E402
from model import LlamaForPretraining  # noqa: E402
from training import errors, stopping, weights  # noqa: E402
from training.errors import UsageError, path_argument  # noqa: E402


MIN_TEMPERATURE = 1e-3  # sharper than this is greedy in all but name; use 0


def sample_next(logits, temperature: float, top_k: int | None, generator: torch.Generator) -> int:
    """Pick the next token from the last position's logits (V,)."""
    if temperature == 0:
        return int(logits.argmax())  # greedy: deterministic
    logits = logits.float() / temperature
    if top_k is not None and top_k < logits.numel():
        kth_largest = logits.topk(top_k).values[-1]
        logits = logits.masked_fill(logits < kth_largest, float("-inf"))  # only the k likeliest remain
    return int(torch.multinomial(logits.softmax(-1), 1, generator=generator))


@torch.no_grad()
def generate(model: LlamaForPretraining, prompt_ids: list[int], max_new_tokens: int, temperature: float = 0.0,
             top_k: int | None = None, generator: torch.Generator | None = None,
             stop_id: int | None = None) -> list[int]:
    """Continue prompt_ids by at most max_new_tokens tokens, ending early at stop_id
    (which is not returned). Returns only the new tokens."""
    model.eval()
    device = model.lm_head.weight.device
    caches = model.new_kv_caches(batch_size=1, max_len=len(prompt_ids) + max_new_tokens)
    x = torch.tensor([prompt_ids], device=device)  # the first forward reads the whole prompt
    new = []
    for _ in range(max_new_tokens):
        logits = model(x, kv_caches=caches)[0, -1]  # (V,): what follows the last token
        token = sample_next(logits, temperature, top_k, generator)
        if token == stop_id:
            break
        new.append(token)
        x = torch.tensor([[token]], device=device)  # from now on, one new token per forward
    return new


def parse_args(argv=None):
    parser = errors.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out_dir", type=path_argument, help="output folder of a training run")
    parser.add_argument("--prompt", default="", help="text to continue (default: none, sample from scratch)")
    parser.add_argument("--max-new-tokens", type=int, help="tokens to generate at most (default: 200, or fewer "
                        "to stay within the sequence length the model was trained at)")
    parser.add_argument("--temperature", type=float, default=0.8,
                        help="sampling temperature; 0 means greedy (always the likeliest token)")
    parser.add_argument("--top-k", type=int, default=50, help="sample among the k likeliest tokens only")
    parser.add_argument("--seed", type=int, default=1337, help="seed of the sampling (same seed, same text)")
    args = parser.parse_args(argv)
    if args.max_new_tokens is not None and args.max_new_tokens < 1:
        raise UsageError(f"--max-new-tokens must be at least 1, got {args.max_new_tokens}")
    if not math.isfinite(args.temperature) or args.temperature < 0:
        raise UsageError(f"--temperature must be a non-negative number, got {args.temperature}")
    if 0 < args.temperature < MIN_TEMPERATURE:  # logits / 1e-45 overflow to inf, and softmax to nan
        raise UsageError(f"--temperature must be 0 (greedy) or at least {MIN_TEMPERATURE}, got {args.temperature}")
    if args.top_k < 1:
        raise UsageError(f"--top-k must be at least 1, got {args.top_k}")
    if not 0 <= args.seed < 2**63:  # torch generators take 64-bit seeds
        raise UsageError(f"--seed must be within 0 and 2^63 - 1, got {args.seed}")
    try:
        args.prompt.encode("utf-8")
    except UnicodeEncodeError:  # bytes the shell passed that are not UTF-8 text
        raise UsageError("--prompt is not valid UTF-8 text") from None
    return args


def main(argv=None):
    args = parse_args(argv)
    model, tokenizer = weights.load_trained(args.out_dir)
    # the prompt is text: a literal "[EOT]" in it is encoded as text, as in training (data.text_only)
    text_ids = text_only(tokenizer).encode(args.prompt, add_special_tokens=False).ids
    specials = special_ids(tokenizer, model.config)  # [BOT] and [EOT], or an imported model's own
    prompt_ids = [specials.bos] + text_ids
    room = model.config.max_position_embeddings  # RoPE's table
    trained = model.config.trained_context  # the run's --seq-len
    max_new_tokens = args.max_new_tokens or max(1, min(200, trained - len(prompt_ids)))  # within what it saw
    if len(prompt_ids) + max_new_tokens > room:
        asked = f"plus --max-new-tokens {max_new_tokens}" if args.max_new_tokens else "and one new token"
        raise UsageError(f"the prompt ({len(prompt_ids)} tokens) {asked} exceed the model's {room} positions")
    if len(prompt_ids) + max_new_tokens > trained:  # RoPE reaches there; the model has never been
        errors.warn(f"the model was trained on sequences of {trained} tokens: the prompt ({len(prompt_ids)} "
                      f"tokens) plus {max_new_tokens} new ones go past what it has seen")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    generator = torch.Generator(device).manual_seed(args.seed)
    new = generate(model.to(device), prompt_ids, max_new_tokens, args.temperature, args.top_k,
                   generator, stop_id=specials.eos)
    # decode prompt and continuation together: a character may span the boundary
    print(tokenizer.decode(prompt_ids + new, skip_special_tokens=True))


if __name__ == "__main__":
    stopping.exit_on_usage_error(main)
