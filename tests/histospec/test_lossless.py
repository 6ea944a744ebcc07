"""HistoSpec is lossless where users run it (issue 26, items 1 and 2).

1. The distribution of tokens drawn at VERIFIED decode positions (a fixed prefix, a fixed draft tree, many
   requests with distinct keys) is the model's softmax there, in fp32 and in bf16 (with AMX tiles where the
   CPU has them, and with them off as on a CPU without AMX), and
   at the second drafted position given that the first was accepted; verifiers that continue from the wrong
   node fail it.
2. Speculative decoding is token-identical to plain decoding over what users set (EOS, top-k, top-p, stop
   strings, a peaky and a moderately sharpened model), with drafts verified and non-first branches accepted
   where a cell says so; a verifier that trusts the first child, or reads the logits row one off, fails the
   matrix in more than one cell.
"""

from __future__ import annotations

import functools
import importlib

import pytest
import torch

from rhymerl.engine.backends import CudaBackend
from rhymerl.engine.engine import Engine
from rhymerl.engine.sampling_params import SamplingParams
from rhymerl.histospec.drafter import Draft
from rhymerl.history import HistoryStore
from helpers import speculator
from tiny_models import VOCAB, random_prompts, tiny_decoder

engine_mod = importlib.import_module("rhymerl.engine.engine")
verify_mod = importlib.import_module("rhymerl.histospec.verify")  # the package re-exports a function `verify`
device_mod = importlib.import_module("rhymerl.engine.device_verification")
static_mod = importlib.import_module("rhymerl.engine.backends.static_step")  # the walk inside the step



def sharpened(scale: float, dtype=torch.float32):
    """The tiny random llama with its output distribution sharpened by `scale` (6: peaky, it mostly repeats
    one token; 3: moderately sharpened, its top token has 0.1-0.4 of the mass)."""
    model = tiny_decoder("llama", dtype)
    with torch.no_grad():
        model.norm.weight.mul_(scale)
    return model


# ---- broken verifiers (mutants) --------------------------------------------------------------------------

def _first_child_accept(children, node, drawn):
    """Broken: sees that the draw is one of the node's children, but goes on from its FIRST child."""
    if (node, drawn) not in children:
        return None
    return min(j for (p, _), j in children.items() if p == node)


def _row_off_verify(real):
    """Broken: a draft node's draw reads the logits row one before its own (the root's row is right)."""
    def verify(drafts, draw):
        return real(drafts, lambda live, nodes, depths: draw(live, [n - 1 if n >= 0 else n for n in nodes], depths))
    return verify


def _first_child_walk(drawn, parent, token, levels):
    """Broken, the device walk's way (`device_verification.walk`): a node whose parent drew ANY child's token
    counts as reached when it is that parent's FIRST child."""
    rows = torch.arange(len(parent), device=parent.device)
    is_root = parent == rows
    sibling = (parent[:, None] == parent[None, :]) & ~is_root[:, None] & ~is_root[None, :]  # [R, R]
    any_child = (sibling & (drawn.gather(0, parent)[:, None] == token[None, :])).any(1)
    first = ~(sibling & (rows[None, :] < rows[:, None])).any(1)  # no sibling before it
    reached = is_root
    for _ in range(levels):
        reached = is_root | (reached.gather(0, parent) & any_child & first)
    return reached


def _first_child_walk_trees(drawn, parent, token, ancestors):
    """`_first_child_walk` in the step's layout (`device_verification.walk_trees`: roots point at the sentinel
    row R of `drawn`)."""
    rows = torch.arange(len(parent), device=parent.device)
    return _first_child_walk(drawn[:-1], torch.where(parent == len(parent), rows, parent), token, ancestors.shape[1])


def apply_mutant(monkeypatch, mutant: str | None) -> None:
    if mutant == "first_child":
        monkeypatch.setattr(verify_mod, "accept", _first_child_accept)
    elif mutant == "first_child_device":  # after the step (`verify_on_device`) and inside it (`StaticStep.draw`)
        monkeypatch.setattr(device_mod, "walk", _first_child_walk)
        monkeypatch.setattr(static_mod, "walk_trees", _first_child_walk_trees)
    elif mutant == "row_off":
        monkeypatch.setattr(engine_mod, "verify", _row_off_verify(verify_mod.verify))
    else:
        assert mutant is None


# ---- 1. distribution over verified tokens -------------------------------------------------------------

def chi2_fails(counts: torch.Tensor, p: torch.Tensor) -> tuple[bool, float, int]:
    """Pearson chi-square of `counts` against probabilities `p` (rare cells pooled): (over a ~4 sigma bound,
    chi2, dof)."""
    n = float(counts.sum())
    expected = p * n
    big = expected >= 5
    obs = torch.cat([counts[big], counts[~big].sum()[None]])
    exp = torch.cat([expected[big], expected[~big].sum()[None]])
    chi2 = float(((obs - exp) ** 2 / exp).sum())
    dof = len(obs) - 1
    return chi2 > dof + 4 * (2 * dof) ** 0.5, chi2, dof


def softmax_after(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        logits = model(torch.tensor([ids], device=next(model.parameters()).device))[0, -1]
        return torch.softmax(logits.double(), -1).cpu()


def sample_verified(model, mutant, monkeypatch, n: int, static: bool = False):
    """`n` requests (distinct ids) on a fixed prompt, T=1, up to 4 tokens; every request whose first token (drawn
    in the prefill, unverified) is the most likely t0 is verified at output position 1 against a FIXED tree:
    root children [c1, c2, c3] (c2 the most likely, listed second) and c2's children [d1, d2].
    Returns the model's distributions, the drawn tokens at positions 1 (given t0) and 2 (given t0, c2), and
    the engine. `static`: on a CPU, the engine runs the CUDA backend's fixed-shape steps eagerly and verifies
    as a GPU does (every node drawn and the walk in tensor ops, inside each step: `StaticStep.draw`); on a GPU
    it does so anyway."""
    prompt = random_prompts(1, seed=64)[0]
    p0 = softmax_after(model, prompt)
    t0 = int(p0.argmax())
    p1 = softmax_after(model, prompt + [t0])
    top1 = p1.topk(3).indices.tolist()
    c1, c2, c3 = top1[1], top1[0], top1[2]
    p2 = softmax_after(model, prompt + [t0, c2])
    top2 = p2.topk(2).indices.tolist()
    tree = Draft(tokens=[c1, c2, c3, top2[1], top2[0]], parents=[-1, -1, -1, 1, 1], source="history",
                 match_len=2, probs=[0.3, 0.4, 0.2, 0.15, 0.25])
    # Every token but t0 and c2 is an EOS token, so that a request stops as soon as it can no longer reach a
    # position this test counts (EOS only cuts a response: the draws at the counted positions are unchanged).
    eos = set(range(VOCAB)) - {t0, c2}
    eng = Engine(model, num_slots=64, max_model_len=32, eos_token_ids=eos, 
                 speculator=speculator("histospec", HistoryStore(), max_draft_tokens=4))
    if static:
        eng.runner.backend = CudaBackend(model, eng.cache, "static")

    def fixed(seqs, rooms, *a, **kw):
        for s in seqs:  # the speculator's state of a sequence (a group of its own: no sibling index to grow)
            if s.spec is None:
                s.spec = eng.speculator.start(s.request_id, s.prompt_ids)
        return [tree if s.output_ids == [t0] and room >= 2 else Draft() for s, room in zip(seqs, rooms)]

    eng.speculator.propose = fixed
    apply_mutant(monkeypatch, mutant)
    outs = eng.generate([prompt] * n, SamplingParams(temperature=1.0, max_tokens=4, seed=11),
                        request_ids=[f"r{i}" for i in range(n)])
    monkeypatch.undo()
    assert eng.speculator.stats.drafted > 0
    first = [o.token_ids[1] for o in outs if o.token_ids[0] == t0]
    second = [o.token_ids[2] for o in outs if o.token_ids[:2] == [t0, c2]]
    assert all(len(o.token_ids) == 4 for o in outs if o.token_ids[:3] == [t0, c2, c2])  # (EOS ends the rest)
    return p1, p2, torch.tensor(first), torch.tensor(second), eng


class NoTiles:
    """The native kernels as on a CPU without AMX (Zen 4, older Xeons): no bf16 tile matmuls."""

    def __init__(self, ops):
        self._ops = ops

    def __getattr__(self, name):
        return getattr(self._ops, name)

    def tile_linear_supported(self):
        return False


@pytest.mark.parametrize("dtype,amx", [(torch.float32, True), (torch.bfloat16, True), (torch.bfloat16, False)],
                         ids=["fp32", "bf16", "bf16-no-amx"])
def test_verified_tokens_follow_the_policy_distribution(dtype, amx, monkeypatch):
    """Chi-square of the tokens drawn at a verified position (against root children [c1, c2, c3]), and at the
    second drafted position given that c2, a non-first child, was accepted, against the model's softmax
    from a plain forward in the same dtype. bf16 runs as this CPU runs it (AMX tiles where it has them) and
    with the tile matmuls off, as on a CPU without AMX."""
    native = importlib.import_module("rhymerl.engine.backends.native")
    if not amx and native.ops() is not None:
        ops = native.ops()
        monkeypatch.setattr(native, "ops", lambda: NoTiles(ops))
    model = sharpened(4.0, dtype)
    p1, p2, first, second, eng = sample_verified(model, None, monkeypatch, n=3000)
    if not amx:
        assert not getattr(eng.runner.backend, "tiles", False)
    assert len(first) > 1200 and len(second) > 500
    for drawn, p in ((first, p1), (second, p2)):
        fails, chi2, dof = chi2_fails(torch.bincount(drawn, minlength=VOCAB).double(), p)
        assert not fails, (chi2, dof)


@pytest.mark.parametrize("mutant", ["first_child", "row_off"])
def test_the_distribution_test_catches_broken_verifiers(mutant, monkeypatch):
    """A verifier that goes on from the wrong node draws the second drafted position from another node's
    logits: the conditional chi-square above rejects it (the first verified position, drawn at the root's
    row, is still right)."""
    model = sharpened(4.0)
    p1, p2, first, second, _ = sample_verified(model, mutant, monkeypatch, n=1000)
    assert not chi2_fails(torch.bincount(first, minlength=VOCAB).double(), p1)[0]
    assert chi2_fails(torch.bincount(second, minlength=VOCAB).double(), p2)[0]


@pytest.mark.parametrize("device", ["cpu", "cuda"], ids=["cpu-bf16", "cuda-bf16"])
def test_the_device_walk_follows_the_policy_distribution(device, monkeypatch):
    """The same chi-square through the GPU's verification (every node drawn and the acceptance walk in tensor
    ops, inside the fixed-shape steps: `StaticStep.draw`): in bf16 on a GPU (CUDA graphs;
    scripts/gpu_check.sh runs this) the verification forward rounds unlike a plain one, so tokens may differ
    from plain decoding's, but their distribution must be the policy's. On a CPU the CUDA backend's steps
    run eagerly, in bf16 too (whose tree forward rounds unlike its one-token forward as well): the same walk,
    exercised wherever the tests run."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    model = sharpened(4.0, torch.bfloat16).to(device)
    walks = []
    # the walk after the step or inside it (the engine's way)
    for mod, name in ((device_mod, "walk"), (static_mod, "walk_trees")):
        real_walk = getattr(mod, name)
        monkeypatch.setattr(mod, name, lambda *a, real_walk=real_walk: walks.append(1) or real_walk(*a))
    p1, p2, first, second, eng = sample_verified(model, None, monkeypatch, n=3000, static=device == "cpu")
    assert isinstance(eng.runner.backend, CudaBackend) and eng.runner.backend.mode != "eager" and walks
    assert len(first) > 1200 and len(second) > 500
    for drawn, p in ((first, p1), (second, p2)):
        fails, chi2, dof = chi2_fails(torch.bincount(drawn, minlength=VOCAB).double(), p)
        assert not fails, (chi2, dof)


def test_the_distribution_test_catches_a_broken_device_walk(monkeypatch):
    """A device walk that goes on from the first child fails the conditional chi-square, as the host walk's
    mutant does."""
    model = sharpened(4.0)
    p1, p2, first, second, _ = sample_verified(model, "first_child_device", monkeypatch, n=1000, static=True)
    assert not chi2_fails(torch.bincount(first, minlength=VOCAB).double(), p1)[0]
    assert chi2_fails(torch.bincount(second, minlength=VOCAB).double(), p2)[0]


# ---- 2. the identity matrix ---------------------------------------------------------------------------

class CharTokenizer:
    """Token i is the character chr(0x100 + i): enough for stop strings (the engine decodes output tails)."""

    eos_token_id = None

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(0x100 + int(i)) for i in ids)


# name: (model scale, temperature, top_k, top_p, eos?, stop?, claims non-first branches accepted)
CELLS = {
    "peaky-greedy-eos": (6.0, 0.0, 0, 1.0, True, False, False),
    "peaky-T1": (6.0, 1.0, 0, 1.0, False, False, True),
    "peaky-T1-eos": (6.0, 1.0, 0, 1.0, True, False, True),
    "peaky-T0.7-topk": (6.0, 0.7, 5, 1.0, False, False, True),
    "peaky-T1-topp": (6.0, 1.0, 0, 0.8, False, False, True),
    "peaky-T1-stop": (6.0, 1.0, 0, 1.0, False, True, True),
    "moderate-greedy": (3.0, 0.0, 0, 1.0, False, False, False),
    "moderate-T0.7-eos-stop": (3.0, 0.7, 0, 1.0, True, True, True),
    "moderate-T0.7-topk-topp": (3.0, 0.7, 10, 0.9, False, False, True),
}
PROMPTS = random_prompts(6, seed=61)
IDS = [f"p{i}-g{g}" for i in range(6) for g in range(2)]  # 2 generations per prompt: siblings
BATCH = [p for p in PROMPTS for _ in range(2)]
N_GEN = 5  # history: earlier epochs of responses per prompt


@functools.lru_cache(maxsize=None)
def model_of(scale: float):
    return sharpened(scale)


def make_engine(model, spec, eos, tokenizer, history=None):
    return Engine(model, tokenizer, num_slots=4, max_model_len=96, eos_token_ids=eos, 
                  speculator=speculator(spec, history))


@functools.lru_cache(maxsize=None)
def plain_setup(name: str):
    """A cell's params, EOS set, tokenizer, history (N_GEN plain epochs with other seeds) and plain outputs.
    The EOS token and the stop string are taken from what the model emits, so that they end some responses
    midway: the most frequent token after the most frequent one."""
    scale, temperature, top_k, top_p, use_eos, use_stop, _ = CELLS[name]
    model = model_of(scale)
    base = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, max_tokens=24, seed=5)
    probe = make_engine(model, "off", [], None).generate(BATCH, base, request_ids=IDS)
    ranked = torch.bincount(torch.tensor([t for o in probe for t in o.token_ids]), minlength=VOCAB).argsort(
        descending=True).tolist()
    eos = [ranked[1]] if use_eos else []
    tokenizer = CharTokenizer() if use_stop else None
    params = SamplingParams(**{**base.__dict__, "stop": (CharTokenizer().decode([ranked[2 if use_eos else 1]]),)
                               if use_stop else ()})
    history = HistoryStore()
    for g in range(N_GEN):
        p = SamplingParams(**{**params.__dict__, "seed": params.seed + 100 + g})
        outs = make_engine(model, "off", eos, tokenizer).generate(PROMPTS, p)
        for prompt, o in zip(PROMPTS, outs):
            history.record_rollout(prompt, [o.token_ids], [1.0])
    plain = make_engine(model, "off", eos, tokenizer).generate(BATCH, params, request_ids=IDS)
    return model, params, eos, tokenizer, history, plain


def run_cell(name: str):
    """Speculative outputs for a cell, and how many accepted draft nodes were a non-first child (a node
    whose parent lists another child before it), from the `verified` the speculator is handed."""
    model, params, eos, tokenizer, history, _ = plain_setup(name)
    eng = make_engine(model, "histospec", eos, tokenizer, history)
    nonfirst = [0]
    commit = eng.speculator.commit

    def spy(seqs, drafts, verified, *a, **kw):
        for d, v in zip(drafts, verified):
            for j in v.path:
                if any(p == d.parents[j] for p in d.parents[:j]):
                    nonfirst[0] += 1
        return commit(seqs, drafts, verified, *a, **kw)

    eng.speculator.commit = spy
    return eng.generate(BATCH, params, request_ids=IDS), eng.speculator.stats, nonfirst[0]


def failing_cells(monkeypatch, mutant: str | None) -> dict[str, str]:
    """Run the matrix (with a broken verifier when `mutant`); the cells whose speculative run is not
    token-identical to plain, with why."""
    failures = {}
    for name in CELLS:
        plain = plain_setup(name)[-1]  # built with the real verifier (it draws no draft)
        apply_mutant(monkeypatch, mutant)
        spec, _, _ = run_cell(name)
        monkeypatch.undo()
        if [o.token_ids for o in spec] != [o.token_ids for o in plain]:
            failures[name] = "tokens"
        elif [o.finish_reason for o in spec] != [o.finish_reason for o in plain]:
            failures[name] = "finish reasons"
        elif [o.text for o in spec] != [o.text for o in plain]:
            failures[name] = "text"
        elif not torch.allclose(torch.tensor([x for o in spec for x in o.logprobs]),
                                torch.tensor([x for o in plain for x in o.logprobs]), atol=1e-4, rtol=1e-4):
            failures[name] = "logprobs"
    return failures


@pytest.mark.parametrize("name", list(CELLS))
def test_speculative_equals_plain_over_user_settings(name):
    *_, params, eos, tokenizer, _, plain = plain_setup(name)
    spec, stats, nonfirst = run_cell(name)
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    assert [o.finish_reason for o in spec] == [o.finish_reason for o in plain]
    assert [o.text for o in spec] == [o.text for o in plain]
    for a, b in zip(spec, plain):
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-4, rtol=1e-4)
    assert stats.drafted > 0 and stats.accepted > 0  # trees were verified, and followed
    if CELLS[name][6]:
        assert nonfirst > 0  # a draw followed a branch other than the first
    if eos or tokenizer:  # the cell's EOS / stop string ended some responses before max_tokens
        assert any(o.finish_reason == "stop" for o in plain)


@pytest.mark.parametrize("mutant", ["first_child", "row_off"])
def test_broken_verifiers_fail_the_matrix(mutant, monkeypatch):
    assert failing_cells(monkeypatch, None) == {}
    broken = failing_cells(monkeypatch, mutant)
    assert len(broken) > 1, broken
