"""Independent numpy forward pass of a llama GGUF (the oracle for the ggml backend).

Written from the llama definition, not from skippy_stage.cpp: weights come from the
``gguf`` package's reader (dequantised with ``gguf.quants``), attention is plain causal
softmax attention in float64 with GQA (query head h uses KV head h // (n_head/n_head_kv)),
RoPE is the NORMAL (adjacent-pair) variant that llama GGUFs use (runtime.md §5.3).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np


class NumpyLlama:
    def __init__(self, path: str | Path) -> None:
        import gguf
        from gguf import quants

        r = gguf.GGUFReader(str(path), "r")

        def scalar(key, default=None):
            f = r.fields.get(key)
            return default if f is None else f.parts[f.data[0]][0].item()

        self.n_layer = int(scalar("llama.block_count"))
        self.n_embd = int(scalar("llama.embedding_length"))
        self.n_head = int(scalar("llama.attention.head_count"))
        self.n_head_kv = int(scalar("llama.attention.head_count_kv", self.n_head))
        self.head_dim = self.n_embd // self.n_head
        self.n_rot = int(scalar("llama.rope.dimension_count", self.head_dim))
        self.eps = float(scalar("llama.attention.layer_norm_rms_epsilon", 1e-5))
        self.base = float(scalar("llama.rope.freq_base", 10000.0))
        self.w: dict[str, np.ndarray] = {}
        for t in r.tensors:
            a = quants.dequantize(t.data, t.tensor_type)
            shape = tuple(int(x) for x in reversed(t.shape.tolist()))  # numpy order: rows = ne1
            self.w[t.name] = np.asarray(a, dtype=np.float64).reshape(shape)
        if "output.weight" not in self.w:
            self.w["output.weight"] = self.w["token_embd.weight"]  # tied head
        self.n_vocab = self.w["token_embd.weight"].shape[0]

    def _rms(self, x, g):
        return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + self.eps) * g

    def _rope(self, x, pos):
        # x: [n, heads, hd]; rotate adjacent pairs (2i, 2i+1) of the first n_rot dims
        half = self.n_rot // 2
        inv = self.base ** (-2.0 * np.arange(half) / self.n_rot)
        ang = pos[:, None].astype(np.float64) * inv[None, :]  # [n, half]
        cos, sin = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
        out = x.copy()
        x0, x1 = x[..., 0 : self.n_rot : 2], x[..., 1 : self.n_rot : 2]
        out[..., 0 : self.n_rot : 2] = x0 * cos - x1 * sin
        out[..., 1 : self.n_rot : 2] = x0 * sin + x1 * cos
        return out

    def forward(self, tokens, layer_start=0, layer_end=None, hidden=None, head=True):
        """Full-sequence causal forward (positions 0..n-1).  Returns logits [n, vocab] when
        ``head`` else the residual stream [n, n_embd] after ``layer_end``."""
        layer_end = self.n_layer if layer_end is None else layer_end
        n = len(tokens)
        pos = np.arange(n)
        x = self.w["token_embd.weight"][np.asarray(tokens)] if hidden is None else np.asarray(hidden, np.float64)
        hd, nh, nkv = self.head_dim, self.n_head, self.n_head_kv
        mask = np.triu(np.full((n, n), -np.inf), 1)
        for i in range(layer_start, layer_end):
            w = lambda s: self.w[f"blk.{i}.{s}.weight"]  # noqa: E731
            h = self._rms(x, w("attn_norm"))
            q = self._rope((h @ w("attn_q").T).reshape(n, nh, hd), pos)
            k = self._rope((h @ w("attn_k").T).reshape(n, nkv, hd), pos)
            v = (h @ w("attn_v").T).reshape(n, nkv, hd)
            out = np.empty((n, nh, hd))
            for hh in range(nh):
                kv = hh // (nh // nkv)
                s = q[:, hh, :] @ k[:, kv, :].T / np.sqrt(hd) + mask
                s = np.exp(s - s.max(axis=1, keepdims=True))
                s /= s.sum(axis=1, keepdims=True)
                out[:, hh, :] = s @ v[:, kv, :]
            x = x + out.reshape(n, nh * hd) @ w("attn_output").T
            h = self._rms(x, w("ffn_norm"))
            g = h @ w("ffn_gate").T
            x = x + ((g / (1.0 + np.exp(-g))) * (h @ w("ffn_up").T)) @ w("ffn_down").T
        if not head:
            return x
        return self._rms(x, self.w["output_norm.weight"]) @ self.w["output.weight"].T
