"""Prefill a shared prompt prefix once (torch-free): which sequences copy which slot's keys and values."""

from __future__ import annotations

from rhymerl.engine.sequence import Sequence


def share_prefixes(seqs: list[Sequence], min_shared: int) -> tuple[dict[int, int], int]:
    """A sequence admitted now copies the keys/values of the longest prefix it shares with a sequence that
    holds it (running) or prefills it in this step, and feeds only the rest of its prompt (at least the last
    token, whose logits it needs). The `num_generations` copies of a GRPO prompt so cost one prefill, and
    prompts under one chat template share its system part. Shorter shares than `min_shared` tokens are
    recomputed. Returns ({follower slot: source slot}, prompt tokens copied) and sets the followers'
    num_cached. The copied keys and values are the same tokens at the same positions: they can differ from a
    recomputation only in the last bits (another batch shape), which the sampler is robust to."""
    if all(seq.num_cached for seq in seqs):
        return {}, 0
    # Sources hold their whole prefix before the copy: running sequences, and this step's full prefills
    # (a follower's own copied positions land in the same layer pass, so it cannot be a source yet).
    held = [seq for seq in seqs if seq.num_cached >= len(seq.prompt_ids)]
    sources, copied = {}, 0
    for seq in seqs:
        if seq.num_cached:
            continue
        shared, source = max(((common_prefix(seq.prompt_ids, h.prompt_ids), h.slot) for h in held),
                             default=(0, -1))
        shared = min(shared, len(seq.prompt_ids) - 1)
        if shared >= min_shared:
            sources[seq.slot] = source
            seq.num_cached = shared
            copied += shared
        else:
            held.append(seq)
    return sources, copied


def common_prefix(a: list[int], b: list[int]) -> int:
    """Length of the longest common prefix of two token lists."""
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n
