# The same speculator decisions on a CPU cost model, main's code vs this branch's: fixed clock, fixed step times.
import json
from rhymerl.cost_model import CostModel
from rhymerl.histospec import speculator
from rhymerl.histospec.speculator import Speculator
from rhymerl.history import HistoryStore

class Clock:
    now = 0.0
    def perf_counter(self):
        self.now += 0.0007
        return self.now
speculator.time = Clock()
cost = CostModel([1, 4, 16, 32], [1, 2, 4, 8, 16, 33], [[0.02 + 0.001 * n * t for t in (1, 2, 4, 8, 16, 33)] for n in (1, 4, 16, 32)], measured=True)
out = []
for c in (0.1, 0.4, 0.8):
    hist = HistoryStore()
    prompt = list(range(1, 11))
    hist.record_rollout(prompt, [list(range(100, 140)), list(range(100, 120)) + list(range(200, 220))])
    spec = Speculator(cost, hist, rule="cost", max_draft_tokens=32)
    spec.load_state_dict({"calibration": {"num": [[c * 1e6] * 33] * 2, "den": [[1e6] * 33] * 2}})
    for step in range(60):
        seqs = 32 if step < 40 else 4
        if spec.drafting_paused(seqs):
            out.append(None); continue
        drafts = spec.plan([prompt[-8:]] * seqs, [spec.start(i, prompt) for i in range(seqs)], seqs, seqs, draining=step >= 40)
        n = sum(len(d.tokens) for d in drafts)
        out.append(n)
        spec.observe_step(cost.step(seqs, seqs, n, max(len(d.tokens) for d in drafts)) * (1.3 if n else 1.1))
print(json.dumps(out))
