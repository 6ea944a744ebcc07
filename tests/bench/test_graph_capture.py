"""`bench spec`'s captures before its timed runs (`GraphCaptures`), on the CUDA backend's "static" mode (the CPU's
stand-in: each (bucket, draw kind) runs once where a GPU captures it): with the bench's temperatures, greedy
included, the timed runs meet no shape first; the figures say how many were captured and what the runs met."""

import pytest

from rhymerl.bench.graph_capture import GraphCaptures
from rhymerl.engine.backends import CudaBackend
from rhymerl.engine.engine import Engine
from rhymerl.engine.kv_cache import KVCache
from rhymerl.engine.model_runner import ModelRunner
from rhymerl.engine.sampling_params import SamplingParams
from tiny_models import random_prompts, tiny_decoder


@pytest.mark.parametrize("temperatures, later", [((0.0, 1.0), False), ((1.0,), True)])
def test_captures_cover_every_temperature_of_the_timed_runs(temperatures, later):
    model = tiny_decoder("llama")
    cache = KVCache.for_model(model, 4, 40)
    runner = ModelRunner(model, cache, backend=CudaBackend(model, cache, "static"))
    prompts = random_prompts(4, lo=5, hi=12, seed=3)
    captures = GraphCaptures([runner.backend, object()], 12, [SamplingParams(temperature=t) for t in temperatures])
    assert len(captures.backends) == 1 and captures.seconds > 0
    engine = Engine(model, num_slots=4, max_model_len=40, eos_token_ids=[], runner=runner)
    for t in (0.0, 0.6):  # a run at T=0.6 replays T=1.0's graphs
        engine.generate(prompts, SamplingParams(temperature=t, max_tokens=6))
    fields = captures.fields()
    assert fields["graphs_captured"] == fields["graphs_captured_later"] == 0  # "static": nothing captured
    assert (fields["shapes_first_run_later"] > 0) == later
    assert GraphCaptures([object()]).fields() == {}
