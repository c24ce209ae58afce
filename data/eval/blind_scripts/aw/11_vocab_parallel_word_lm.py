"""Word-level LM with a very large vocabulary: vocab-parallel embedding and
vocab-parallel softmax / cross-entropy over a tensor-parallel group, data
parallelism over the other dimension.

    torchrun --nproc_per_node=8 11_vocab_parallel_word_lm.py --tp 4 \
        --train-files /data/news/train_*.txt --valid-file /data/news/valid.txt
"""
import argparse
import glob
import json
import math
import os
from collections import Counter

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


def parse():
    ap = argparse.ArgumentParser()
    ap.add_argument("--train-files", required=True)
    ap.add_argument("--valid-file", required=True)
    ap.add_argument("--save-dir", default="ckpt/word_lm")
    ap.add_argument("--tp", type=int, default=4)
    ap.add_argument("--min-freq", type=int, default=3)
    ap.add_argument("--bptt", type=int, default=256)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--dim", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--lr", type=float, default=5e-4)
    ap.add_argument("--epochs", type=int, default=10)
    ap.add_argument("--seed", type=int, default=7)
    return ap.parse_args()


def build_vocab(files, min_freq, tp):
    counts = Counter()
    for path in files:
        with open(path, encoding="utf-8") as f:
            for line in f:
                counts.update(line.split())
    words = {w for w, c in counts.items() if c >= min_freq}
    itos = ["<pad>", "<unk>", "<eos>"] + list(words)
    while len(itos) % (tp * 128):
        itos.append(f"<extra_{len(itos)}>")
    return itos, {w: i for i, w in enumerate(itos)}


class StreamLM(Dataset):
    def __init__(self, files, stoi, bptt):
        ids = []
        unk, eos = stoi["<unk>"], stoi["<eos>"]
        for path in files:
            with open(path, encoding="utf-8") as f:
                for line in f:
                    ids.extend(stoi.get(w, unk) for w in line.split())
                    ids.append(eos)
        self.data = torch.tensor(ids, dtype=torch.long)
        self.bptt = bptt

    def __len__(self):
        return (self.data.numel() - 1) // self.bptt

    def __getitem__(self, i):
        s = i * self.bptt
        return self.data[s:s + self.bptt], self.data[s + 1:s + self.bptt + 1]


class _Copy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, g):
        g = g.contiguous()
        dist.all_reduce(g, group=ctx.group)
        return g, None


class _Reduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        x = x.contiguous()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, g):
        return g, None


class VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, vocab_start, vocab_end, group):
        logits = logits.float()
        lmax = logits.max(dim=-1)[0]
        dist.all_reduce(lmax, op=dist.ReduceOp.MAX, group=group)
        logits = logits - lmax.unsqueeze(-1)
        outside = (target < vocab_start) | (target >= vocab_end)
        local_t = (target - vocab_start).masked_fill(outside, 0)
        arange = torch.arange(logits.size(0), device=logits.device)
        picked = logits[arange, local_t].masked_fill(outside, 0.0)
        dist.all_reduce(picked, group=group)
        exp = logits.exp()
        sum_exp = exp.sum(dim=-1)
        dist.all_reduce(sum_exp, group=group)
        loss = sum_exp.log() - picked
        softmax = exp.div_(sum_exp.unsqueeze(-1))
        ctx.save_for_backward(softmax, outside, local_t)
        return loss

    @staticmethod
    def backward(ctx, grad_out):
        softmax, outside, local_t = ctx.saved_tensors
        grad = softmax
        arange = torch.arange(grad.size(0), device=grad.device)
        grad[arange, local_t] -= (~outside).float()
        return grad * grad_out.unsqueeze(-1), None, None, None, None


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab, dim, group):
        super().__init__()
        tp, r = dist.get_world_size(group), dist.get_rank(group)
        self.group = group
        self.per = vocab // tp
        self.start, self.end = r * self.per, (r + 1) * self.per
        self.weight = nn.Parameter(torch.randn(self.per, dim) * 0.02)

    def forward(self, ids):
        outside = (ids < self.start) | (ids >= self.end)
        emb = F.embedding((ids - self.start).masked_fill(outside, 0), self.weight)
        return _Reduce.apply(emb.masked_fill(outside.unsqueeze(-1), 0.0), self.group)

    def logits(self, h):
        return F.linear(_Copy.apply(h, self.group), self.weight)


class WordLM(nn.Module):
    def __init__(self, vocab, a, group):
        super().__init__()
        self.emb = VocabParallelEmbedding(vocab, a.dim, group)
        self.pos = nn.Parameter(torch.zeros(a.bptt, a.dim))
        layer = nn.TransformerEncoderLayer(a.dim, a.heads, 4 * a.dim, dropout=0.1, batch_first=True, norm_first=True)
        self.body = nn.TransformerEncoder(layer, a.layers)
        self.norm = nn.LayerNorm(a.dim)
        self.register_buffer("causal", nn.Transformer.generate_square_subsequent_mask(a.bptt), persistent=False)

    def forward(self, ids):
        T = ids.size(1)
        h = self.body(self.emb(ids) + self.pos[:T], mask=self.causal[:T, :T], is_causal=True)
        return self.emb.logits(self.norm(h))


def main():
    a = parse()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    tp_group = dp_group = None
    for i in range(world // a.tp):
        g = dist.new_group(list(range(i * a.tp, (i + 1) * a.tp)))
        if rank // a.tp == i:
            tp_group = g
    for j in range(a.tp):
        g = dist.new_group(list(range(j, world, a.tp)))
        if rank % a.tp == j:
            dp_group = g
    tp_rank, dp_rank, dp_size = rank % a.tp, rank // a.tp, world // a.tp
    device = torch.device("cuda", local_rank)

    files = sorted(glob.glob(a.train_files))
    itos, stoi = build_vocab(files, a.min_freq, a.tp)
    if rank == 0:
        os.makedirs(a.save_dir, exist_ok=True)
        with open(os.path.join(a.save_dir, "vocab.json"), "w") as f:
            json.dump(itos, f)
        print(f"vocab size {len(itos)} ({len(itos) // a.tp} per TP rank)", flush=True)

    train_ds = StreamLM(files, stoi, a.bptt)
    valid_ds = StreamLM([a.valid_file], stoi, a.bptt)
    sampler = DistributedSampler(train_ds, num_replicas=dp_size, rank=dp_rank, shuffle=True, seed=a.seed)
    train_dl = DataLoader(train_ds, a.batch_size, sampler=sampler, drop_last=True, num_workers=2)
    valid_dl = DataLoader(valid_ds, a.batch_size, drop_last=True,
                          sampler=DistributedSampler(valid_ds, num_replicas=dp_size, rank=dp_rank, shuffle=False))

    torch.manual_seed(a.seed + tp_rank)
    model = WordLM(len(itos), a, tp_group).to(device)
    # the transformer body is replicated across the TP group: start it identical
    for p in model.parameters():
        if p is not model.emb.weight:
            dist.broadcast(p.data, src=dp_rank * a.tp, group=tp_group)
    ddp = DDP(model, device_ids=[local_rank], process_group=dp_group)
    opt = torch.optim.AdamW(ddp.parameters(), lr=a.lr, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, a.lr, total_steps=a.epochs * len(train_dl), pct_start=0.02)

    def lm_loss(x, y):
        logits = ddp(x.to(device))
        loss = VocabParallelCrossEntropy.apply(logits.flatten(0, 1), y.to(device).flatten(),
                                               model.emb.start, model.emb.end, tp_group)
        return loss.mean()

    best = float("inf")
    for epoch in range(a.epochs):
        sampler.set_epoch(epoch)
        ddp.train()
        for i, (x, y) in enumerate(train_dl):
            loss = lm_loss(x, y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            if rank == 0 and i % 100 == 0:
                print(f"epoch {epoch} it {i}/{len(train_dl)} loss {loss.item():.3f} ppl {math.exp(loss.item()):.1f}", flush=True)

        ddp.eval()
        tot = torch.zeros(2, device=device)
        with torch.no_grad():
            for x, y in valid_dl:
                tot += torch.stack([lm_loss(x, y), torch.ones((), device=device)])
        dist.all_reduce(tot, group=dp_group)
        val = (tot[0] / tot[1]).item()
        if rank == 0:
            print(f"epoch {epoch} valid loss {val:.3f} ppl {math.exp(val):.1f}", flush=True)
        if val < best:
            best = val
            if dp_rank == 0:
                os.makedirs(a.save_dir, exist_ok=True)
                torch.save({"model": model.state_dict(), "epoch": epoch, "tp": a.tp, "val": val},
                           os.path.join(a.save_dir, f"best_tp{tp_rank}.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
