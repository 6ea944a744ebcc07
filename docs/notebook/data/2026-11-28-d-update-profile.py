import time, torch, statistics, sys
from rhymerl.bench.update_bench import batch
from rhymerl.config import TrainSection
from rhymerl.model.fetch import resolve_model_dir
from rhymerl.model.weights import load_decoder
from rhymerl.process import deterministic_algorithms, setup_process
from rhymerl.rl.trainer import PolicyTrainer
setup_process(0, "cpu")
dec = load_decoder(resolve_model_dir("smollm2-135m"), torch.float32, "cpu")
mbs = int(sys.argv[1]) if len(sys.argv) > 1 else 16
cfg = TrainSection(micro_batch_size=mbs, dtype="bf16", total_steps=10)
tr = PolicyTrainer(dec.train(), cfg, 1.0, 192)
# the e2e job: 12 prompts x 8, prompt ~70 tokens, completions ~ 45 mean (use max 90 -> mean ~67)
bs = [batch(s, 8, 8, 70, 90, dec.cfg.vocab_size) for s in range(3)]
for i, b in enumerate(bs):
    t0 = time.perf_counter()
    with deterministic_algorithms():
        tr.update(b)
    print(i, round(time.perf_counter() - t0, 2), sum(len(s.completion_ids) for s in b), flush=True)
if "--prof" in sys.argv:
    from torch.profiler import profile, ProfilerActivity
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as p:
        with deterministic_algorithms():
            tr.update(bs[0])
    print(p.key_averages(group_by_input_shape=False).table(sort_by="self_cpu_time_total", row_limit=14, max_name_column_width=50, max_shapes_column_width=60))
