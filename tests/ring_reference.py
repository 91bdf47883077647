"""Inputs and the plain-PyTorch reference of the ring-attention tests (in-process and over gloo): full causal softmax
attention per map, differentiated by autograd.

Each kind's head layout, as its core attention hands it to the ring (``(batch, heads, sequence, size)``):
- ``diff``: 2H = 4 query heads of d, 2Hkv = 2 key heads of d, Hkv = 1 value head of 2d; map 1 is query heads 0, 2
  with key head 0, map 2 query heads 1, 3 with key head 1, both over the one value head (GQA: 2 query heads a group);
- ``diff_v2``: 2H = 4 query heads over Hkv = 1 key and value head of d, one map;
- ``vanilla``: 4 query heads over 2 key and value heads of d, one map.
"""

import torch

D = 8
KINDS = {  # query heads, key heads, value heads, value size, (query heads, key heads) of each map
    "diff": (4, 2, 1, 2 * D, ((slice(0, None, 2), slice(0, None, 2)), (slice(1, None, 2), slice(1, None, 2)))),
    "diff_v2": (4, 1, 1, D, ((slice(None), slice(None)),)),
    "vanilla": (4, 2, 2, D, ((slice(None), slice(None)),)),
}
SCALE = 0.3


def ring_inputs(kind: str, ranks: int, dtype: torch.dtype, batch: int = 2, chunk: int = 4, seed: int = 0):
    """q, k, v of a sequence of 2·ranks·chunk positions, upstream gradients of each map's output, and the maps."""
    queries, keys, values, value_size, maps = KINDS[kind]
    generator = torch.Generator().manual_seed(seed)
    s = 2 * ranks * chunk

    def draw(*shape):
        return torch.randn(*shape, generator=generator, dtype=torch.float64).to(dtype)

    q, k, v = draw(batch, queries, s, D), draw(batch, keys, s, D), draw(batch, values, s, value_size)
    grads_out = [draw(batch, queries // len(maps), s, value_size) for _ in maps]
    return q, k, v, grads_out, maps


def full_attention(q, k, v, grads_out, maps):
    """Each map's causal softmax attention over the whole sequence and the gradients of q, k, v (autograd)."""
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    outs = []
    for q_heads, k_heads in maps:
        qm, km = q[:, q_heads], k[:, k_heads]
        groups = qm.shape[1] // km.shape[1]
        km, vm = km.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
        scores = qm @ km.transpose(-1, -2) * SCALE
        s = scores.shape[-1]
        scores = scores.masked_fill(~torch.ones(s, s, dtype=torch.bool).tril(), float("-inf"))
        outs.append(torch.softmax(scores, -1) @ vm)
    torch.autograd.backward(outs, grads_out)
    result = {f"out{m}": o.detach() for m, o in enumerate(outs)}
    result.update(dq=q.grad, dk=k.grad, dv=v.grad)
    return result
