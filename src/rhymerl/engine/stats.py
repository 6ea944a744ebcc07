"""An engine's counters (torch-free): forwards, tokens, time."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class EngineStats:
    forward_passes: int = 0
    tokens_forwarded: int = 0  # tokens fed through the model: prompts + decode tokens (+ drafts)
    prompt_tokens: int = 0  # prompt tokens fed through the model
    shared_prompt_tokens: int = 0  # prompt tokens not fed: copied from a slot holding the same prefix
    generated_tokens: int = 0  # tokens appended to outputs
    busy_s: float = 0.0  # wall time inside step()
    forward_s: float = 0.0  # of which in the model's forward (on a GPU: queuing it; it runs while the host goes on)
    device_wait_s: float = 0.0  # of which waiting for the device's results (on a GPU: the forward and the draws)
    seq_steps: int = 0  # sum over steps of the sequences in the step
    # Migration: requests handed to another engine (`Engine.extract`) and adopted from one
    # (`Engine.adopt`: each migration counts once, where it lands), the prompt + generated tokens the adopted
    # ones re-prefilled, and those tokens' share of the forward time of the steps that fed them.
    handed_over: int = 0
    migrations: int = 0
    migration_prefill_tokens: int = 0
    migration_prefill_s: float = 0.0

    @property
    def host_s(self) -> float:
        """The host's own time in step(): everything outside the backend's forward and the wait for the device's
        results (scheduling, drafting, packing the draws, sampler bookkeeping, commits, stats). On a GPU the
        forward and the draws only queue work, so this is what the device waits on; on a CPU, where they
        compute in place, it also holds the draws' own arithmetic (small with a small vocabulary)."""
        return self.busy_s - self.forward_s - self.device_wait_s

    @property
    def tokens_per_forward(self) -> float:
        """Generated tokens per forward pass."""
        return self.generated_tokens / max(self.forward_passes, 1)

    @property
    def tokens_per_seq_forward(self) -> float:
        """Tokens each sequence commits per forward it takes part in: 1 without speculation."""
        return self.generated_tokens / max(self.seq_steps, 1)

    def merge(self, other: "EngineStats") -> None:
        """Add another's counters to these (several workers' stats into one)."""
        for name, value in vars(other).items():
            setattr(self, name, getattr(self, name) + value)
