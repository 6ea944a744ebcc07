"""How one rank of a multi-rank update (`train.world_size` > 1, `rl/ranks.py`) holds the policy and shares the
work: `train.strategy` fsdp (FSDP2's `fully_shard` per decoder layer, then the root: weights, gradients and
AdamW state sharded) or ddp (a full replica, gradients all-reduced in buckets).

Exactness against one process (docs/design.md section 4, "Several ranks"): every rank holds the whole batch
and cuts it into the same micro-batches as one process would (`PolicyTrainer._micro_batches`); rank r runs
micro-batches r, r + N, ... Each micro-batch's loss is already rescaled to the whole batch's normaliser, so
the gradient is the sum of the micro-batches' gradients whichever rank ran them: the collectives must sum,
not average (FSDP's divide factor is set to 1, with plain sums; DDP divides by N, so its ranks scale their loss by N, exact
for a power of two). A rank with fewer micro-batches runs a zero-weighted copy of one, because every rank
must join every forward's all-gathers and the last backward's reduction. Gradients synchronise once per
optimizer step, on the last micro-batch. The metrics' sums are all-reduced (the largest difference by max).

Mixed precision: the ranks gather fp32 weights and keep today's bf16 autocast around the forward, so a bf16
update rounds as the single-process one does; gathering bf16 (`param_dtype`) would halve the all-gathers but
round the norms' weights too. Gradients are reduced in fp32.
"""

from __future__ import annotations

from contextlib import contextmanager, nullcontext

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                     get_optimizer_state_dict, set_optimizer_state_dict)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard, register_fsdp_forward_method
from torch.nn.parallel import DistributedDataParallel

from rhymerl.model.decoder import Decoder

STRATEGIES = ("fsdp", "ddp")
_FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)


class _Packed(nn.Module):
    """Routes `forward` to `Decoder.forward_packed`, so that DDP's forward (which readies its gradient
    buckets) runs around the packed forward the update calls."""

    def __init__(self, decoder: Decoder):
        super().__init__()
        self.decoder = decoder

    def forward(self, *args, **kwargs):
        return self.decoder.forward_packed(*args, **kwargs)


class _PackedDDP(DistributedDataParallel):
    """DDP over `_Packed`, answering `forward_packed` as a Decoder does (what `token_logprobs` calls)."""

    def forward_packed(self, *args, **kwargs):
        return self(*args, **kwargs)


class Sharding:
    """One rank's share of the update: `wrap` the policy (and reference), which micro-batches are its
    (`share`), when gradients synchronise (`grad_sync`), the metric sums reduced (`reduce`), and the full
    weights and optimizer state gathered on rank 0 (`full_params`, `optimizer_state`)."""

    def __init__(self, strategy: str, rank: int, world_size: int, device: torch.device):
        if strategy not in STRATEGIES:
            raise ValueError(f"train.strategy: unknown strategy {strategy!r}; expected one of {STRATEGIES}")
        self.strategy, self.rank, self.world_size, self.device = strategy, rank, world_size, device
        self.decoder: Decoder | None = None  # the policy as a Decoder (inside DDP's wrapper; FSDP's own module)
        # DDP averages gradients over ranks; the micro-batch losses must add up, so each is scaled by N
        self.loss_factor = float(world_size) if strategy == "ddp" else 1.0

    def wrap(self, model: Decoder, ref_model: Decoder | None = None) -> tuple[nn.Module, nn.Module | None]:
        """The policy (and reference) as this rank trains with them; call before building the optimizer."""
        self.decoder = model
        if self.strategy == "ddp":  # the reference needs no gradients: a plain replica
            return _PackedDDP(_Packed(model)), ref_model
        mesh = init_device_mesh(self.device.type, (self.world_size,))
        return self._fully_shard(model, mesh, grads=True), (self._fully_shard(ref_model, mesh, grads=False)
                                                             if ref_model is not None else None)

    @staticmethod
    def _fully_shard(model: Decoder, mesh, grads: bool) -> Decoder:
        policy = MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32)
        for layer in model.layers:  # one all-gather per layer; the root holds embeddings, final norm, lm_head
            fully_shard(layer, mesh=mesh, mp_policy=policy)
        fully_shard(model, mesh=mesh, mp_policy=policy)
        register_fsdp_forward_method(model, "forward_packed")  # the update calls it, not forward
        if grads:  # sum the micro-batches' gradients (module docstring); gloo has no AVG nor PREMUL_SUM
            for module in (*model.layers, model):
                module.set_gradient_divide_factor(1.0)
                module.set_force_sum_reduction_for_comms(True)
        return model

    def share(self, batches: list[list]) -> list[tuple[list, bool]]:
        """This rank's micro-batches as (micro-batch, live): batches[rank::N], padded with zero-weighted
        copies of batches[0] (live False) to as many as the busiest rank runs."""
        if not batches:  # nothing trained this step (every advantage 0, no KL term)
            return []
        mine = [(mb, True) for mb in batches[self.rank::self.world_size]]
        per_rank = -(-len(batches) // self.world_size)
        return mine + [(batches[0], False)] * (per_rank - len(mine))

    def grad_sync(self, model: nn.Module, last: bool):
        """Context for one micro-batch's forward/backward: gradients reduced across ranks only on the last."""
        if self.strategy == "ddp":
            return nullcontext() if last else model.no_sync()
        model.set_requires_gradient_sync(last)
        return nullcontext()

    def reduce(self, acc: dict) -> dict:
        """The update's metric accumulators summed over ranks ("diff_max": the largest)."""
        keys = [k for k in acc if k != "diff_max"]
        sums = torch.tensor([float(acc[k]) for k in keys], dtype=torch.float64, device=self.device)
        dist.all_reduce(sums)
        top = torch.tensor([acc["diff_max"]], dtype=torch.float64, device=self.device)
        dist.all_reduce(top, op=dist.ReduceOp.MAX)
        out = dict(zip(keys, sums.tolist()))
        out["tok"], out["tok0"] = int(out["tok"]), int(out["tok0"])
        return out | {"diff_max": top.item()}

    def sum_squares(self, local: torch.Tensor) -> float:
        """The gradient's sum of squares over ranks from this rank's (float64): FSDP's shards add up, DDP's
        replicas hold the whole gradient already."""
        if self.strategy == "ddp":
            return float(local)
        total = local.to(self.device, torch.float64).reshape(1)
        dist.all_reduce(total)
        return total.item()

    def full_params(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """The policy's full parameters under Decoder names, on rank 0 (on a CPU); {} elsewhere. Every rank
        calls it (FSDP all-gathers each parameter once)."""
        names = [n for n, _ in self.decoder.named_parameters()]  # tied weights once, as merged_parameters
        if self.strategy == "ddp":
            return {n: p.detach() for n, p in self.decoder.named_parameters()} if self.rank == 0 else {}
        full = get_model_state_dict(model, options=_FULL)
        return {n: full[n] for n in names} if self.rank == 0 else {}

    def optimizer_state(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
        """The full AdamW state in a single process's `optimizer.state_dict()` layout (parameters by
        index), on rank 0 ({} elsewhere): a checkpoint any world size resumes from. Every rank calls it."""
        if self.strategy == "ddp":
            state = optimizer.state_dict() if self.rank == 0 else {}
            return _cloned(state)
        full = get_optimizer_state_dict(model, optimizer, options=_FULL)
        if self.rank != 0:
            return {}
        index = {n: i for i, n in enumerate(_trained_names(model))}
        return {"state": {index[n]: s for n, s in full["state"].items()},
                "param_groups": [g | {"params": [index[n] for n in g["params"]]} for g in full["param_groups"]]}

    def load_optimizer_state(self, model: nn.Module, optimizer: torch.optim.Optimizer, state: dict) -> None:
        """Load `optimizer_state`'s layout (from any world size; rank 0's copy is the one read)."""
        if self.strategy == "ddp":
            optimizer.load_state_dict(state)
            return
        names = _trained_names(model)
        by_name = {} if self.rank != 0 else {
            "state": {names[int(i)]: s for i, s in state["state"].items()},
            "param_groups": [g | {"params": [names[int(i)] for i in g["params"]]} for g in state["param_groups"]]}
        set_optimizer_state_dict(model, optimizer, optim_state_dict=by_name,
                                 options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))


class CommCounter:
    """Bytes this rank hands to each collective of the update (what `rhymerl bench update` reports): FSDP's
    all-gathers and reduce-scatters (torch.distributed's functions, wrapped in this process), DDP's bucket
    all-reduces (routed through the wrapped `all_reduce` by torch's `allreduce_hook`, which does what DDP does
    by default: divide by N, all-reduce) and the metric sums.
    An all-gather counts its output, a reduce-scatter its input: the full tensor either way."""

    _WRAPPED = {"all_gather_single": "all_gather", "reduce_scatter_single": "reduce_scatter", "all_reduce": "all_reduce"}

    def __init__(self):
        self.bytes = {kind: 0 for kind in self._WRAPPED.values()}

    def install(self, model: nn.Module) -> None:
        """Count from now on in this process (`model`: the wrapped policy, for DDP's hook)."""
        for name, kind in self._WRAPPED.items():
            original = getattr(dist, name)

            def counted(*args, _original=original, _kind=kind, **kwargs):
                full = _full_tensor(_kind, args, kwargs)
                self.bytes[_kind] += full.numel() * full.element_size()
                return _original(*args, **kwargs)

            setattr(dist, name, counted)
        if isinstance(model, DistributedDataParallel):  # its buckets' all-reduces through dist.all_reduce
            model.register_comm_hook(None, allreduce_hook)

    def take(self) -> dict[str, int]:
        """The bytes since the last call, by collective."""
        out, self.bytes = self.bytes, {kind: 0 for kind in self.bytes}
        return out


def _full_tensor(kind: str, args: tuple, kwargs: dict) -> torch.Tensor:
    """The full-size tensor of a collective call: an all-gather's output, a reduce-scatter's input."""
    if kind == "reduce_scatter":  # reduce_scatter_single(output, input, ...)
        return kwargs["input"] if "input" in kwargs else args[1]
    if kind == "all_gather":  # all_gather_single(output_tensor, input_tensor, ...)
        return kwargs["output_tensor"] if "output_tensor" in kwargs else args[0]
    return kwargs["tensor"] if "tensor" in kwargs else args[0]  # all_reduce(tensor, ...)


def _trained_names(model: nn.Module) -> list[str]:
    """Names of the trained parameters in the optimizer's order (it is built from the same filter)."""
    return [n for n, p in model.named_parameters() if p.requires_grad]


def _cloned(state):
    """A copy of a state dict whose tensors are on a CPU and share nothing with the live optimizer."""
    if isinstance(state, torch.Tensor):
        return state.detach().to("cpu", copy=True)
    if isinstance(state, dict):
        return {k: _cloned(v) for k, v in state.items()}
    if isinstance(state, list):
        return [_cloned(v) for v in state]
    return state


def init_group(backend: str, rank: int, world_size: int, addr: str | None = None, port: int | None = None) -> None:
    """Join torch.distributed's default group: TCP rendezvous at rank 0's `addr`:`port`, or (None) at the
    environment's MASTER_ADDR / MASTER_PORT with RANK / WORLD_SIZE (what torchrun sets)."""
    init = f"tcp://{addr}:{port}" if port is not None else "env://"
    dist.init_process_group(backend, init_method=init, rank=rank, world_size=world_size)


@contextmanager
def process_group(backend: str, rank: int, world_size: int, addr: str | None = None, port: int | None = None):
    """`init_group` for the block, the group destroyed on exit."""
    init_group(backend, rank, world_size, addr, port)
    try:
        yield
    finally:
        dist.destroy_process_group()
