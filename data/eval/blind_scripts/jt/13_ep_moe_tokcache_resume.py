"""
Expert-parallel top-2 MoE pretraining on raw jsonl text.

* text is tokenized once into <cache>/{split}.u16 (rank 0 writes, the others wait)
* experts are sharded across ranks; dense weights are averaged by DDP, expert weights are not
* checkpoints: one dense file + one expert shard per rank, resumable only on the same EP size

    torchrun --nproc_per_node=8 13_ep_moe_tokcache_resume.py --corpus /data/wiki_en --cache /data/wiki_en/tok
    torchrun --nproc_per_node=8 13_ep_moe_tokcache_resume.py --corpus /data/wiki_en --cache /data/wiki_en/tok --resume
"""
import argparse
import datetime
import json
import math
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


def args_():
    p = argparse.ArgumentParser()
    p.add_argument("--corpus", required=True)
    p.add_argument("--cache", required=True)
    p.add_argument("--ckpt", default="ckpt/ep_top2")
    p.add_argument("--resume", action="store_true")
    p.add_argument("--tokenizer", default="gpt2")
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--dim", type=int, default=768)
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--experts", type=int, default=32)
    p.add_argument("--cap", type=float, default=1.25)
    p.add_argument("--aux", type=float, default=0.01)
    p.add_argument("--bs", type=int, default=8)
    p.add_argument("--lr", type=float, default=5e-4)
    p.add_argument("--warmup", type=int, default=1000)
    p.add_argument("--steps", type=int, default=40000)
    p.add_argument("--ckpt_every", type=int, default=1000)
    return p.parse_args()


def build_token_cache(corpus, cache, tokenizer_name):
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(tokenizer_name)
    os.makedirs(cache, exist_ok=True)
    for split in ("train", "val"):
        final = os.path.join(cache, f"{split}.u16")
        if os.path.exists(final):
            continue
        ids = []
        with open(os.path.join(corpus, f"{split}.jsonl")) as f:
            for line in f:
                ids += tok(json.loads(line)["text"])["input_ids"] + [tok.eos_token_id]
        tmp = final + ".tmp"
        np.asarray(ids, dtype=np.uint16).tofile(tmp)
        os.replace(tmp, final)


class U16Windows(Dataset):
    def __init__(self, path, seq):
        self.path, self.seq = path, seq
        self.n = (os.path.getsize(path) // 2 - 1) // seq
        self.mm = None

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        if self.mm is None:
            self.mm = np.memmap(self.path, dtype=np.uint16, mode="r")
        t = torch.from_numpy(self.mm[i * self.seq:(i + 1) * self.seq + 1].astype(np.int64))
        return t[:-1], t[1:]


class _A2A(torch.autograd.Function):
    @staticmethod
    def forward(ctx, group, x):
        ctx.group = group
        y = torch.empty_like(x)
        dist.all_to_all_single(y, x.contiguous(), group=group)
        return y

    @staticmethod
    def backward(ctx, gy):
        return None, _A2A.apply(ctx.group, gy)


class FFN(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.fc = nn.Linear(d, 4 * d)
        self.proj = nn.Linear(4 * d, d)

    def forward(self, x):
        return self.proj(F.gelu(self.fc(x)))


class EPMoE(nn.Module):
    def __init__(self, d, n_experts, cap, group):
        super().__init__()
        self.group = group
        self.ep = dist.get_world_size(group)
        self.E, self.cap = n_experts, cap
        self.nl = n_experts // self.ep
        self.gate = nn.Linear(d, n_experts, bias=False)
        self.experts = nn.ModuleList(FFN(d) for _ in range(self.nl))
        self.aux = None
        self.n_dropped = None

    def forward(self, x):
        B, T, D = x.shape
        x = x.reshape(-1, D)
        N = x.size(0)
        probs = self.gate(x).float().softmax(-1)
        w, e = probs.topk(2, -1)
        w = w / w.sum(-1, keepdim=True)
        self.aux = self.E * (F.one_hot(e[:, 0], self.E).float().mean(0) * probs.mean(0)).sum()
        C = math.ceil(self.cap * 2 * N / self.E)
        ef, wf = e.t().reshape(-1), w.t().reshape(-1)
        tf = torch.arange(N, device=x.device).repeat(2)
        oh = F.one_hot(ef, self.E)
        pos = (oh * oh.cumsum(0)).sum(-1) - 1
        keep = pos < C
        self.n_dropped = (~keep).sum()
        slot = ef[keep] * C + pos[keep]
        tk = tf[keep]
        buf = x.new_zeros(self.E * C, D)
        buf[slot] = x[tk]
        h = _A2A.apply(self.group, buf).view(self.ep, self.nl, C, D)
        h = torch.cat([self.experts[j](h[:, j:j + 1]) for j in range(self.nl)], dim=1)
        h = _A2A.apply(self.group, h.reshape(-1, D))
        y = torch.zeros(N, D, device=x.device, dtype=h.dtype).index_add(0, tk, h[slot] * wf[keep, None].to(h.dtype))
        return y.to(x.dtype).view(B, T, D)


class Block(nn.Module):
    def __init__(self, a, group, moe):
        super().__init__()
        self.h = a.heads
        self.n1, self.n2 = nn.LayerNorm(a.dim), nn.LayerNorm(a.dim)
        self.qkv = nn.Linear(a.dim, 3 * a.dim)
        self.o = nn.Linear(a.dim, a.dim)
        self.ff = EPMoE(a.dim, a.experts, a.cap, group) if moe else FFN(a.dim)

    def forward(self, x):
        B, T, D = x.shape
        q, k, v = self.qkv(self.n1(x)).view(B, T, 3, self.h, -1).permute(2, 0, 3, 1, 4)
        x = x + self.o(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, T, D))
        return x + self.ff(self.n2(x))


class Net(nn.Module):
    def __init__(self, a, group):
        super().__init__()
        self.emb = nn.Embedding(50304, a.dim)
        self.pos = nn.Embedding(a.seq, a.dim)
        self.blocks = nn.ModuleList(Block(a, group, moe=i % 2 == 1) for i in range(a.layers))
        self.norm = nn.LayerNorm(a.dim)

    def forward(self, idx, tgt):
        x = self.emb(idx) + self.pos(torch.arange(idx.size(1), device=idx.device))
        for b in self.blocks:
            x = b(x)
        logits = F.linear(self.norm(x), self.emb.weight).float()
        moes = [b.ff for b in self.blocks if isinstance(b.ff, EPMoE)]
        return (F.cross_entropy(logits.flatten(0, 1), tgt.flatten()),
                torch.stack([m.aux for m in moes]).mean(),
                torch.stack([m.n_dropped for m in moes]).sum())


def main():
    a = args_()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    # generous timeout: the first run tokenizes the corpus on rank 0 while the others wait
    dist.init_process_group("nccl", timeout=datetime.timedelta(hours=3))
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", local_rank)
    ep_group = dist.new_group(list(range(world)))

    if rank == 0:
        build_token_cache(a.corpus, a.cache, a.tokenizer)
    dist.barrier()

    torch.manual_seed(100 + rank)
    net = Net(a, ep_group).to(dev)
    expert_keys = [n for n, _ in net.named_parameters() if ".experts." in n]
    DDP._set_params_and_buffers_to_ignore_for_model(net, expert_keys)
    model = DDP(net, device_ids=[local_rank])  # broadcasts rank 0's dense weights
    experts = [p for n, p in net.named_parameters() if ".experts." in n]
    opt = torch.optim.AdamW(net.parameters(), lr=a.lr, betas=(0.9, 0.95), weight_decay=0.1)

    step = 0
    os.makedirs(a.ckpt, exist_ok=True)
    if a.resume and os.path.exists(os.path.join(a.ckpt, "dense.pt")):
        dense = torch.load(os.path.join(a.ckpt, "dense.pt"), map_location=dev)
        if dense["ep_size"] != world:
            raise SystemExit(f"checkpoint was written with EP={dense['ep_size']}, this job has {world} ranks")
        step = dense["step"]
        shard = torch.load(os.path.join(a.ckpt, f"experts-{step:07d}-{rank:02d}-of-{world:02d}.pt"),
                           map_location=dev)
        net.load_state_dict({**dense["model"], **shard["model"]})
        opt.load_state_dict(shard["opt"])

    ds = U16Windows(os.path.join(a.cache, "train.u16"), a.seq)
    sampler = DistributedSampler(ds, shuffle=True, seed=0, drop_last=True)
    dl = DataLoader(ds, a.bs, sampler=sampler, num_workers=4, pin_memory=True, drop_last=True)
    steps_per_epoch = len(dl)

    def lr_at(s):
        return a.lr * min(1.0, (s + 1) / a.warmup) * max(0.1, 0.5 * (1 + math.cos(math.pi * s / a.steps)))

    t0 = time.time()
    while step < a.steps:
        epoch = step // steps_per_epoch
        sampler.set_epoch(epoch)
        skip = step % steps_per_epoch
        for i, (x, y) in enumerate(dl):
            if i < skip:
                continue
            for g in opt.param_groups:
                g["lr"] = lr_at(step)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                ce, aux, n_drop = model(x.to(dev, non_blocking=True), y.to(dev, non_blocking=True))
            (ce + a.aux * aux).backward()
            for p in experts:
                p.grad.div_(world)
            gn_sq = torch.stack([p.grad.float().pow(2).sum() for p in experts]).sum()
            dist.all_reduce(gn_sq)
            gn_sq += sum(p.grad.float().pow(2).sum() for n, p in net.named_parameters() if ".experts." not in n)
            coef = (1.0 / (gn_sq.sqrt() + 1e-6)).clamp(max=1.0)
            for p in net.parameters():
                p.grad.mul_(coef)
            opt.step()
            opt.zero_grad(set_to_none=True)
            step += 1

            if step % 20 == 0:
                s = torch.stack([ce.detach(), aux.detach(), n_drop.float()])
                dist.all_reduce(s)
                if rank == 0:
                    n_assign = 2 * x.numel() * len([b for b in net.blocks if isinstance(b.ff, EPMoE)]) * world
                    print(f"step {step} ce {s[0] / world:.4f} aux {s[1] / world:.4f} "
                          f"dropped {s[2] / n_assign:.2%} {(time.time() - t0) / 20:.3f}s/step", flush=True)
                t0 = time.time()

            if step % a.ckpt_every == 0 or step == a.steps:
                sd = net.state_dict()
                torch.save({"model": {k: v for k, v in sd.items() if ".experts." in k}, "opt": opt.state_dict()},
                           os.path.join(a.ckpt, f"experts-{step:07d}-{rank:02d}-of-{world:02d}.pt"))
                dist.barrier()  # every shard is on disk before the dense file points at this step
                if rank == 0:
                    torch.save({"model": {k: v for k, v in sd.items() if ".experts." not in k},
                                "step": step, "ep_size": world}, os.path.join(a.ckpt, "dense.pt"))
            if step >= a.steps:
                break

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
