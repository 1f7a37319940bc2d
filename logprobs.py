"""The training forward's view of a generation batch: padded tensors, micro-batches, log π of each
completion token.

A GRPO step scores P·G completions under the current policy: for completion i of prompt p, the
training forward runs over prompt + completion and reads, at each position that predicts a
completion token, log π(token | everything before it) and the entropy of π there. Three pieces:

    collate              (prompt ids, completions) -> input_ids (B, T) right-padded, prompt and
                         completion lengths, truncation flags, the sampler's own log-probs (B, L)
    micro_batches        the batch cut into plan.py's micro-batches, each trimmed to its longest row
    completion_logprobs  the forward (model(..., return_hidden=True)), then the lm_head on the
                         predicting rows only, a chunk of rows at a time (ChunkLogprobs), so the
                         (rows × vocab) logits exist for one chunk at a time in the forward and in the
                         backward alike: at a 152k vocabulary a chunk of 1024 rows is 0.6 GB in fp32

Masks come from the recorded lengths, never from pad ids (a pad id can be a real token). The
log-probs are taken at the sampling temperature, as the sampler recorded its own (logits / T).

Test: tests/test_train.py (completion_logprobs against a dense log-softmax in float64, gradients too;
micro-batched gradients against the whole batch's).
"""
import torch

import ops

# ----------------------------------------------------------------------------------------------
# log-probabilities of completions through the training forward

class ChunkLogprobs(torch.autograd.Function):
    """log π(target) and the entropy of π for a chunk of rows h (n, H) through the lm_head W (V, H) at
    a temperature, without keeping the (n, V) logits for the backward: it keeps h and log Z (n,), and
    the backward multiplies once more, then forms d log π(t) / d logits = onehot(t) - softmax. Both
    halves' passes over (n, V) are ops.logprob_stats / logprob_grad, one fused kernel each on the GPU;
    autograd through logsumexp and gather under a checkpoint would make several times as many (and
    recompute the entropy). W is frozen (no gradient for it)."""

    @staticmethod
    def logits(h, weight, temperature):
        """(n, V) fp32 logits at the temperature; the forward and the backward each form them."""
        z = ops.head_matmul(h, weight)
        return z if temperature == 1.0 else z.div_(temperature)

    @staticmethod
    def forward(ctx, h, weight, target, temperature):
        logits = ChunkLogprobs.logits(h, weight, temperature)                      # (n, V) fp32
        logp, ent, logz = ops.logprob_stats(logits, target)                        # (n,) each
        ctx.save_for_backward(h, weight, target, logz)
        ctx.temperature = temperature
        return logp, ent

    @staticmethod
    def backward(ctx, grad_logp, grad_ent):
        h, weight, target, logz = ctx.saved_tensors
        T = ctx.temperature
        logits = ChunkLogprobs.logits(h, weight, T)                                # (n, V) fp32
        g = ops.logprob_grad(logits, logz, target, grad_logp / T, h.dtype)        # d/dlogits (n, V)
        return g @ weight, None, None, None                                        # (n, H)


def completion_logprobs(model, input_ids, prompt_lens, comp_lens, temperature: float, chunk: int = 1024):
    """log π(token) and entropy for every completion token, lm_head applied in chunks.

    input_ids (B, T) = prompt + completion (+ right padding); prompt_lens, comp_lens (B,).
    Returns logp, entropy: (B, L) fp32 with L = max(comp_lens); positions past a completion are 0.
    Only the hidden rows that predict completion tokens reach lm_head, chunk rows at a time
    (ChunkLogprobs), so the (rows × vocab) logits exist for one chunk at a time, in the forward and
    in the backward alike. The entropy is reported, not trained on (it carries no gradient)."""
    B, T = input_ids.shape
    L = int(comp_lens.max())
    hidden = model(input_ids, return_hidden=True)                                  # (B, T, H)
    j = torch.arange(L, device=input_ids.device)                                   # (L,)
    valid = j[None] < comp_lens[:, None]                                           # (B, L)
    pos = (prompt_lens[:, None] - 1 + j[None]).clamp(max=T - 2)                    # (B, L) predicting rows
    rows_b, rows_j = valid.nonzero(as_tuple=True)                                  # (N,), (N,)
    h = hidden[rows_b, pos[rows_b, rows_j]]                                        # (N, H)
    target = input_ids[rows_b, pos[rows_b, rows_j] + 1]                            # (N,)
    W = model.lm_head.weight                                                       # (V, H)
    outs = [ChunkLogprobs.apply(h[s:s + chunk], W, target[s:s + chunk], temperature)
            for s in range(0, h.shape[0], chunk)]
    logp = torch.zeros(B, L, device=h.device).index_put((rows_b, rows_j), torch.cat([o[0] for o in outs]))
    ent = torch.zeros(B, L, device=h.device).index_put((rows_b, rows_j), torch.cat([o[1] for o in outs]).detach())
    return logp, ent


# ----------------------------------------------------------------------------------------------
# a generation batch


def collate(groups: list, pad_id: int, device) -> dict:
    """groups: [train.Group] (prompt_ids, G completions each) -> padded tensors for the training forward."""
    rows = [(g.prompt_ids, c) for g in groups for c in g.completions]
    T = max(len(p) + len(c.token_ids) for p, c in rows)
    L = max(len(c.token_ids) for _, c in rows)
    ids = torch.full((len(rows), T), pad_id, dtype=torch.long)
    sampler_logp = torch.zeros(len(rows), L)
    for i, (p, c) in enumerate(rows):
        seq = p + c.token_ids
        ids[i, :len(seq)] = torch.tensor(seq)
        sampler_logp[i, :len(c.logprobs)] = torch.tensor(c.logprobs)
    return {"input_ids": ids.to(device),
            "prompt_lens": torch.tensor([len(p) for p, _ in rows], device=device),
            "comp_lens": torch.tensor([len(c.token_ids) for _, c in rows], device=device),
            "truncated": torch.tensor([c.finish_reason == "length" for _, c in rows], device=device),
            "sampler_logp": sampler_logp.to(device)}


def micro_batches(batch: dict, spans: list):
    """(start, micro-batch) for each (start, end) of plan.micro_batches, cut to its own longest row."""
    comp = batch["comp_lens"].tolist()
    lens = [p + c for p, c in zip(batch["prompt_lens"].tolist(), comp)]
    for s, e in spans:
        mb = {k: v[s:e] for k, v in batch.items()}
        L, T = max(comp[s:e]), max(lens[s:e])
        mb["input_ids"], mb["sampler_logp"] = mb["input_ids"][:, :T], mb["sampler_logp"][:, :L]
        yield s, mb
