"""The engine, HistoSpec, the sampler and the trainer on a CUDA GPU, against references on the CPU. Skipped
where there is no GPU. The RL loop's own tests (test_training_loop.py) also run on the GPU where there is
one: `TrainingRun` takes it."""

import copy

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from rhymerl.config import TrainSection
from rhymerl.engine.backends import CudaBackend
from rhymerl.engine.device_verification import StepDraws
from rhymerl.engine.engine import Engine
from rhymerl.engine.kv_cache import KVCache
from rhymerl.engine.model_runner import ModelRunner, SlotInput
from rhymerl.engine.sampler import keyed_uniforms, sample
from rhymerl.engine.sampling_params import SamplingParams, draw_key, draw_prefix, request_key
from rhymerl.model.pretrained import chat_prompt_ids
from rhymerl.model.weights import load_decoder
from rhymerl.rl.trainer import PolicyTrainer

from helpers import history_of, peaky, reference_generate, speculator, training_samples
from tiny_models import random_prompts, tiny_decoder

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.fixture(autouse=True)
def cuda_graphs(monkeypatch):
    """Every engine here replays CUDA graphs (the default: whatever the caller's environment says)."""
    monkeypatch.delenv("RHYMERL_CUDA_GRAPHS", raising=False)


def cuda_engine(model, spec="off", history=None, slots=4):
    return Engine(model, num_slots=slots, max_model_len=96, eos_token_ids=[], 
                  speculator=speculator(spec, history))


@pytest.mark.parametrize("params", [SamplingParams(temperature=0, max_tokens=16),
                                    SamplingParams(temperature=1.0, max_tokens=16, seed=7)])
def test_engine_on_cuda_matches_the_cpu_reference(params):
    """The GPU engine samples the tokens that the dense CPU reference loop samples: keyed randomness does
    not depend on the device."""
    cpu = tiny_decoder("llama")
    gpu = copy.deepcopy(cpu).to("cuda")
    prompts = random_prompts(6, seed=1)
    outs = cuda_engine(gpu, slots=3).generate(prompts, params, request_ids=[f"r{i}" for i in range(6)])
    for i, (p, o) in enumerate(zip(prompts, outs)):
        toks, logps = reference_generate(cpu, p, params, f"r{i}")
        assert o.token_ids == toks
        torch.testing.assert_close(torch.tensor(o.logprobs), torch.tensor(logps), atol=1e-4, rtol=1e-4)


def test_sampler_draws_the_same_tokens_on_cuda_and_cpu():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(64, 49152, generator=g) * 4
    keys = [draw_key(3, request_key(f"q{i}"), i) for i in range(64)]
    for params in (SamplingParams(temperature=0.7), SamplingParams(temperature=1.0, top_k=50, top_p=0.9)):
        cpu_tokens, cpu_logps = sample(logits, params, keys)
        gpu_tokens, gpu_logps = sample(logits.cuda(), params, keys)
        assert gpu_tokens == cpu_tokens
        torch.testing.assert_close(torch.tensor(gpu_logps), torch.tensor(cpu_logps), atol=1e-5, rtol=1e-5)


def test_keyed_uniforms_are_the_same_bits_on_cuda_and_cpu():
    """The noise is integer arithmetic and exact conversions (`sampler._uniforms`: a uint64 view widened by the
    kernel's own cast), so a GPU's uniforms are the CPU's bit for bit."""
    g = torch.Generator().manual_seed(1)
    keys = torch.randint(-(1 << 63), (1 << 63) - 1, (64,), generator=g)
    cols = torch.randint(0, 1 << 41, (64, 448), generator=g)
    cpu = keyed_uniforms(keys, cols)
    assert torch.equal(keyed_uniforms(keys.cuda(), cols.cuda()).cpu().view(torch.int64), cpu.view(torch.int64))


@pytest.mark.parametrize("temperature", [0.0, 0.3, 1.0])
def test_histospec_on_cuda_is_token_identical_to_plain(temperature):
    model = peaky(tiny_decoder("llama-d64")).to("cuda")
    prompts = random_prompts(6, seed=21)
    params = SamplingParams(temperature=temperature, max_tokens=24, seed=5)
    history = history_of(model, prompts, params)
    ids = [f"p{i}-g{g}" for i in range(6) for g in range(2)]
    batch = [p for p in prompts for _ in range(2)]
    plain = cuda_engine(model).generate(batch, params, request_ids=ids)
    spec_engine = cuda_engine(model, "histospec", history)
    spec = spec_engine.generate(batch, params, request_ids=ids)
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    for a, b in zip(spec, plain):
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-4, rtol=1e-4)
    assert spec_engine.speculator.stats.drafted > 0
    backend = spec_engine.runner.backend  # decode and verification steps went through CUDA graphs
    assert backend.captured > 0 and backend.replays > backend.captured


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_graph_replays_give_the_eager_static_steps_logits(dtype):
    """The same decode and verification steps, replayed from CUDA graphs and run eagerly ("static"), on
    two caches: the same logits (a replay runs the captured kernels on the refilled buffers) and the same
    cache contents; a second step of the same shape replays without a new capture."""
    model = tiny_decoder("llama-d64", dtype).to("cuda")
    c = model.cfg
    prompts = random_prompts(3, lo=6, hi=20, seed=4)
    runners = []
    for mode in ("graphs", "static"):
        cache = KVCache(c.num_layers, 4, 96, c.num_kv_heads, c.head_dim, dtype, "cuda", 8)
        runner = ModelRunner(model, cache)
        runner.backend = CudaBackend(model, cache, mode)
        runner.run([SlotInput(s, 0, p[:-1], logits_from=len(p) - 2) for s, p in zip((0, 1, 3), prompts)])  # prefill
        runners.append(runner)
    captured = runners[0].backend.captured
    steps = [[SlotInput(s, len(p) - 1, p[-1:]) for s, p in zip((0, 1, 3), prompts)],  # decode
             [SlotInput(0, len(prompts[0]), [5, 6, 7, 8], [-1, 0, 0, 1]),  # verification: trees and a plain row
              SlotInput(1, len(prompts[1]), [9]), SlotInput(3, len(prompts[2]), [4, 3], [-1, 0])],
             [SlotInput(s, len(p) + 1, [s + 1]) for s, p in zip((0, 1, 3), prompts)]]  # decode: the same shape
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    for inputs in steps:
        graphed, eager = (r.run(inputs, float_logits=False) for r in runners)
        torch.testing.assert_close(graphed, eager, **tol)
    torch.testing.assert_close(runners[0].cache.kv, runners[1].cache.kv, **tol)
    backend = runners[0].backend
    assert backend.captured == captured + 2 and backend.replays == 1 and backend.eager_parts == 0
    # New weights copied in place (RolloutWorker.load_weights) are what the next replay multiplies by
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(0.9)
    inputs = [SlotInput(s, len(p) + 2, [s + 2]) for s, p in zip((0, 1, 3), prompts)]
    graphed, eager = (r.run(inputs, float_logits=False) for r in runners)
    torch.testing.assert_close(graphed, eager, **tol)
    assert backend.replays == 2


def test_in_step_draws_replay_what_the_static_step_draws():
    """Forward, draws and acceptance walk in one graph (`CudaBackend.forward_drawn`), fp32: the replays draw
    the tokens and reach the tree nodes that the same steps run eagerly ("static") do, with the same
    log-probs; one graph serves two temperatures (a buffer), greedy takes a graph of its own."""
    model = peaky(tiny_decoder("llama-d64")).to("cuda")
    c = model.cfg
    prompts = random_prompts(3, lo=6, hi=20, seed=4)
    slots = (0, 1, 3)
    runners = []
    for mode in ("graphs", "static"):
        cache = KVCache(c.num_layers, 4, 96, c.num_kv_heads, c.head_dim, torch.float32, "cuda", 8)
        runner = ModelRunner(model, cache)
        runner.backend = CudaBackend(model, cache, mode)
        runner.run([SlotInput(s, 0, p[:-1], logits_from=len(p) - 2) for s, p in zip(slots, prompts)])  # prefill
        runners.append(runner)
    steps = [[SlotInput(s, len(p) - 1, p[-1:]) for s, p in zip(slots, prompts)],  # decode
             [SlotInput(0, len(prompts[0]), [5, 6, 7, 8], [-1, 0, 0, 1]),  # verification: trees and a plain row
              SlotInput(1, len(prompts[1]), [9]), SlotInput(3, len(prompts[2]), [4, 3], [-1, 0])]]
    backend, captured = runners[0].backend, []
    for params in (SamplingParams(temperature=0.7, seed=1), SamplingParams(temperature=1.0, seed=2),
                   SamplingParams(temperature=0)):
        for inputs in steps:
            draws = StepDraws([draw_prefix(params.seed, request_key(f"r{s}")) for s in slots], [3, 5, 8], params)
            (graphed, gi), (eager, ei) = (r.run_drawn(inputs, draws) for r in runners)
            graphed, eager = graphed.cpu()[:, gi], eager.cpu()[:, ei]
            assert torch.equal(graphed[0], eager[0]) and torch.equal(graphed[2], eager[2])  # tokens, reached
            torch.testing.assert_close(graphed[1], eager[1], atol=1e-5, rtol=1e-5)
        captured.append(backend.captured)
    assert captured[0] == captured[1] < captured[2]  # a new temperature replays; greedy captures
    assert backend.eager_parts == 0


def test_every_shape_is_captured_for_every_draw_kind_before_the_runs():
    """Issue 34 item 2: `capture_every_shape` with a run's SamplingParams (greedy, temperature, top-p) captures
    every graph the runs then replay, the cost model's measured steps having captured theirs first; HistoSpec
    runs at each of them capture nothing more. The captures' seconds are counted apart (`capture_s`)."""
    model = peaky(tiny_decoder("llama-d64")).to("cuda")
    prompts = random_prompts(4, seed=11)
    kinds = [SamplingParams(temperature=0, max_tokens=12), SamplingParams(temperature=0.7, max_tokens=12, seed=1),
             SamplingParams(temperature=1.0, top_p=0.9, max_tokens=12, seed=2)]
    engine = Engine(model, num_slots=4, max_model_len=96, eos_token_ids=[],
                    speculator=speculator("histospec", history_of(model, prompts, kinds[1]), cost=None))
    cost, backend = engine.cost_model, engine.runner.backend
    assert cost.padded_rows and cost.draft_step_s == 0 and backend.captured > 0  # its steps drew in their graphs
    done, seconds = backend.capture_every_shape(max(map(len, prompts)), kinds)
    captured, first = backend.captured, backend.first_runs
    assert done > 0 and 0 < backend.capture_s and backend.captured == first  # no capture failed
    for params in kinds:
        engine.generate(prompts, params)
    assert (backend.captured, backend.first_runs) == (captured, first) and backend.replays > 0


def test_a_cuda_model_runs_the_cuda_backend(monkeypatch):
    """select_backend gives a CUDA model the CUDA backend (CUDA graphs) and no CPU kernels; its logits are the
    eager CPU forward's."""
    cpu = tiny_decoder("llama")
    gpu = copy.deepcopy(cpu).to("cuda")
    c = cpu.cfg
    prompt = random_prompts(1, seed=2)[0]
    logits = {}
    for name, model in (("cpu", cpu), ("cuda", gpu)):
        cache = KVCache(c.num_layers, 2, 64, c.num_kv_heads, c.head_dim, torch.float32, name)
        runner = ModelRunner(model, cache, fused=False)
        logits[name] = runner.run([SlotInput(1, 0, prompt)]).cpu()
    runner = ModelRunner(gpu, KVCache(c.num_layers, 2, 64, c.num_kv_heads, c.head_dim, torch.float32, "cuda"))
    assert isinstance(runner.backend, CudaBackend) and runner.ops is None and runner.backend.mode == "graphs"
    assert ModelRunner(gpu, runner.cache, fused=False).backend.mode == "eager"
    monkeypatch.setenv("RHYMERL_CUDA_GRAPHS", "0")
    assert ModelRunner(gpu, runner.cache).backend.mode == "eager"
    torch.testing.assert_close(logits["cuda"], logits["cpu"], atol=1e-4, rtol=1e-4)


def test_measured_cost_model_on_cuda_is_positive_and_grows_with_tokens():
    """The start-up cost model times real forwards; on a GPU the clock must wait for them (the runner
    synchronises), so the times are those of the work, not of its launch."""
    model = tiny_decoder("llama").to("cuda")
    cost = Engine(model, num_slots=8, max_model_len=512, speculator=speculator(cost=None, max_draft_tokens=32)).cost_model
    smallest, largest = cost.times[0][0], cost.times[-1][-1]
    assert 0 < smallest <= largest


def test_trainer_update_on_cuda_matches_the_cpu():
    """One micro-batched GRPO update in fp32: the same loss metrics and the same gradients on both devices.
    (Gradients, not the new weights: Adam divides by the gradient's own size, so a weight whose gradient is
    rounding noise moves by a full step in either direction.)"""
    cpu = tiny_decoder().train()
    gpu = copy.deepcopy(cpu).to("cuda")
    cfg = TrainSection(micro_batch_size=2, loss_type="dapo", dtype="fp32", max_grad_norm=1.0, learning_rate=1e-3,
                       recompute_logprobs=False)
    samples = training_samples(group=3)
    metrics, grads = {}, {}
    for name, model in (("cpu", cpu), ("cuda", gpu)):
        trainer = PolicyTrainer(model, cfg, temperature=0.7, max_completion_length=8)
        trainer.optimizer.register_step_pre_hook(  # the accumulated gradient, right before the optimizer step
            lambda *_, m=model, k=name: grads.update({k: {n: p.grad.cpu() for n, p in m.named_parameters()}}))
        metrics[name] = trainer.update(samples)
    assert metrics["cuda"]["actor/trained_seqs"] == metrics["cpu"]["actor/trained_seqs"] > 0
    for key in ("actor/pg_loss", "actor/grad_norm"):
        assert metrics["cuda"][key] == pytest.approx(metrics["cpu"][key], rel=1e-4, abs=1e-6), key
    for name, g in grads["cpu"].items():
        torch.testing.assert_close(grads["cuda"][name], g, rtol=1e-4, atol=1e-6, msg=name)


def test_real_model_greedy_on_cuda_equals_transformers_generate(smollm2_dir):
    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    hf = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).to("cuda").eval()
    ours = load_decoder(smollm2_dir, torch.float32, "cuda")
    prompts = [chat_prompt_ids(tok, q) for q in ("What is 3 + 4?", "Name a color.", "Hi")]
    engine = Engine(ours, tok, num_slots=2, max_model_len=256)
    outs = engine.generate(prompts, SamplingParams(temperature=0, max_tokens=24))
    eos = sorted(engine.eos_token_ids)
    for p, o in zip(prompts, outs):
        with torch.inference_mode():
            ref = hf.generate(torch.tensor([p], device="cuda"), max_new_tokens=24, do_sample=False,
                              eos_token_id=eos, pad_token_id=eos[0])[0, len(p):].tolist()
        assert o.token_ids == ref[: len(o.token_ids)] and len(o.token_ids) == len(ref)
