import sys, torch
import torch.nn.functional as F
import rhymerl.model.decoder as d
if sys.argv[1] == "old":
    def attend(self, layer, q, kv):
        g, length = self.gather.shape
        n_kv = kv.shape[1] // 2
        flat = self.gather.reshape(-1)
        qb = q.index_select(0, flat).view(g, length, *q.shape[1:]).transpose(1, 2)
        kvb = kv.index_select(0, flat).view(g, length, *kv.shape[1:]).transpose(1, 2)
        k, v = kvb[:, :n_kv], kvb[:, n_kv:]
        out = F.scaled_dot_product_attention(qb, k, v, is_causal=True, enable_gqa=qb.shape[1] != k.shape[1])
        return out.transpose(1, 2).reshape(g * length, q.shape[1], q.shape[2]).index_select(0, self.scatter)
    d.BranchAttention.attend = attend
sys.argv = ["x", "16"]
exec(open("docs/notebook/data/2026-11-28-d-update-profile.py").read())
