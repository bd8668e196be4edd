"""Generation's cache of keys and values (model.py's new_kv_caches, tools/generate.py)."""

import torch


class KVCache:
    """One layer's keys and values of every token so far, for generation: each new token
    then costs one query against the cache instead of a forward over the whole prefix.
    config: the model's LlamaConfig."""

    def __init__(self, config, batch_size: int, max_len: int, device, dtype):
        shape = (batch_size, config.num_key_value_heads, max_len, config.head_dim)  # (B, K, max_len, D)
        self.k = torch.zeros(shape, device=device, dtype=dtype)
        self.v = torch.zeros(shape, device=device, dtype=dtype)
        self.length = 0  # positions filled so far

    def append(self, k, v):
        """Store k, v (B, K, T, D) after the cached positions; return all of them so far."""
        start, end = self.length, self.length + k.shape[2]
        if end > self.k.shape[2]:
            raise ValueError(f"KV cache holds {self.k.shape[2]} positions, {end} needed")
        self.k[:, :, start:end], self.v[:, :, start:end] = k, v
        self.length = end
        return self.k[:, :, :end], self.v[:, :, :end]
