"""SimplE (Kazemi & Poole 2018) on FB15k-237, multi-GPU with periodic checkpoints and resume.

    torchrun --nproc_per_node=8 16_simple_fb15k237_resume.py --exp_dir exp/simple_fb237
    # after a crash / preemption:
    torchrun --nproc_per_node=8 16_simple_fb15k237_resume.py --exp_dir exp/simple_fb237 --resume
"""
import argparse
import glob
import json
import os
import re
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", default="data/FB15k-237")
    ap.add_argument("--exp_dir", required=True)
    ap.add_argument("--resume", action="store_true")
    ap.add_argument("--emb_dim", type=int, default=200)
    ap.add_argument("--neg_ratio", type=int, default=10)
    ap.add_argument("--batch_size", type=int, default=1024)
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument("--reg_lambda", type=float, default=0.03)
    ap.add_argument("--epochs", type=int, default=1000)
    ap.add_argument("--save_every", type=int, default=50)
    ap.add_argument("--keep", type=int, default=3)
    return ap.parse_args()


def read_split(data, name, e2i, r2i):
    with open(os.path.join(data, name + ".txt")) as f:
        return torch.tensor([[e2i[h], r2i[r], e2i[t]] for h, r, t in (ln.strip().split("\t") for ln in f)])


class NegSampled(Dataset):
    def __init__(self, triples, n_ent, ratio):
        self.triples, self.n_ent, self.ratio = triples, n_ent, ratio

    def __len__(self):
        return len(self.triples)

    def __getitem__(self, i):
        pos = self.triples[i]
        neg = pos.repeat(self.ratio, 1)
        rnd = torch.randint(self.n_ent, (self.ratio,))
        head = torch.rand(self.ratio) < 0.5
        neg[head, 0] = rnd[head]
        neg[~head, 2] = rnd[~head]
        return torch.cat([pos[None], neg]), torch.tensor([1.0] + [-1.0] * self.ratio)


class SimplE(nn.Module):
    def __init__(self, n_ent, n_rel, dim):
        super().__init__()
        self.ent_h = nn.Embedding(n_ent, dim)
        self.ent_t = nn.Embedding(n_ent, dim)
        self.rel = nn.Embedding(n_rel, dim)
        self.rel_inv = nn.Embedding(n_rel, dim)
        bound = 6 / dim ** 0.5
        for e in (self.ent_h, self.ent_t, self.rel, self.rel_inv):
            nn.init.uniform_(e.weight, -bound, bound)

    def forward(self, x):
        h, r, t = x[..., 0], x[..., 1], x[..., 2]
        s1 = (self.ent_h(h) * self.rel(r) * self.ent_t(t)).sum(-1)
        s2 = (self.ent_h(t) * self.rel_inv(r) * self.ent_t(h)).sum(-1)
        score = torch.clamp((s1 + s2) / 2, -20, 20)
        reg = sum(e.pow(2).sum() for e in (self.ent_h(h), self.ent_t(h), self.ent_h(t), self.ent_t(t),
                                          self.rel(r), self.rel_inv(r)))
        return score, reg / x.numel() * 3

    @torch.no_grad()
    def rank_tails(self, h, r):
        return ((self.ent_h(h) * self.rel(r)) @ self.ent_t.weight.t()
                + (self.ent_t(h) * self.rel_inv(r)) @ self.ent_h.weight.t()) / 2

    @torch.no_grad()
    def rank_heads(self, r, t):
        return ((self.rel(r) * self.ent_t(t)) @ self.ent_h.weight.t()
                + (self.ent_h(t) * self.rel_inv(r)) @ self.ent_t.weight.t()) / 2


@torch.no_grad()
def evaluate(model, triples, hr_t, rt_h, device, rank, world, bs=512):
    model.eval()
    mine = triples[rank::world]
    tot = torch.zeros(5, dtype=torch.float64, device=device)
    for i in range(0, len(mine), bs):
        b = mine[i:i + bs].to(device)
        for scores, gold, filt in ((model.rank_tails(b[:, 0], b[:, 1]), b[:, 2], [hr_t[(h, r)] for h, r, _ in b.tolist()]),
                                   (model.rank_heads(b[:, 1], b[:, 2]), b[:, 0], [rt_h[(r, t)] for _, r, t in b.tolist()])):
            g = scores.gather(1, gold[:, None])
            for j, f in enumerate(filt):
                scores[j, f] = float("-inf")
            rk = 1 + (scores > g).sum(1).double()
            tot += torch.stack([(1 / rk).sum(), (rk <= 1).sum(), (rk <= 3).sum(), (rk <= 10).sum(),
                                torch.tensor(float(len(rk)), dtype=torch.float64, device=device)])
    dist.all_reduce(tot)
    return dict(zip(("mrr", "hits@1", "hits@3", "hits@10"), (tot[:4] / tot[4]).tolist()))


def latest_checkpoint(exp_dir):
    files = glob.glob(os.path.join(exp_dir, "ckpt_epoch*.pt"))
    if not files:
        return None
    return max(files, key=lambda p: int(re.search(r"ckpt_epoch(\d+)\.pt", p).group(1)))


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    with open(os.path.join(args.data, "entities.dict")) as f:
        e2i = {n: int(i) for i, n in (l.strip().split("\t") for l in f)}
    with open(os.path.join(args.data, "relations.dict")) as f:
        r2i = {n: int(i) for i, n in (l.strip().split("\t") for l in f)}
    train, valid, test = (read_split(args.data, s, e2i, r2i) for s in ("train", "valid", "test"))
    hr_t, rt_h = {}, {}
    for h, r, t in torch.cat([train, valid, test]).tolist():
        hr_t.setdefault((h, r), []).append(t)
        rt_h.setdefault((r, t), []).append(h)

    model = SimplE(len(e2i), len(r2i), args.emb_dim).to(device)
    ddp = DDP(model, device_ids=[local_rank])
    opt = torch.optim.Adagrad(ddp.parameters(), lr=args.lr, initial_accumulator_value=0.1)

    start_epoch, history = 0, []
    ckpt_file = latest_checkpoint(args.exp_dir) if args.resume else None
    if ckpt_file:
        ckpt = torch.load(ckpt_file)
        model.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["optimizer"])
        start_epoch, history = ckpt["epoch"], ckpt["history"]
        if rank == 0:
            print(f"resumed from {ckpt_file} (epoch {start_epoch})", flush=True)
        del ckpt

    ds = NegSampled(train, len(e2i), args.neg_ratio)
    sampler = DistributedSampler(ds, shuffle=True)
    loader = DataLoader(ds, batch_size=args.batch_size, sampler=sampler, num_workers=4, pin_memory=True)
    if rank == 0:
        os.makedirs(args.exp_dir, exist_ok=True)

    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)
        ddp.train()
        t0, acc = time.time(), torch.zeros(2, device=device)
        for x, y in loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            score, reg = ddp(x)
            loss = F.softplus(-y * score).mean() + args.reg_lambda * reg
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            acc += torch.stack([loss.detach(), torch.ones((), device=device)])
        dist.all_reduce(acc)
        if rank == 0:
            print(f"epoch {epoch + 1}: loss {(acc[0] / acc[1]).item():.4f} ({time.time() - t0:.1f}s)", flush=True)

        if (epoch + 1) % args.save_every == 0:
            metrics = evaluate(model, valid, hr_t, rt_h, device, rank, world)
            history.append({"epoch": epoch + 1, **metrics})
            if rank == 0:
                print(f"  valid {json.dumps(metrics)}", flush=True)
                torch.save({"epoch": epoch + 1, "model": model.state_dict(), "optimizer": opt.state_dict(),
                            "history": history}, os.path.join(args.exp_dir, f"ckpt_epoch{epoch + 1}.pt"))
                old = sorted(glob.glob(os.path.join(args.exp_dir, "ckpt_epoch*.pt")),
                             key=lambda p: int(re.search(r"ckpt_epoch(\d+)\.pt", p).group(1)))[:-args.keep]
                for p in old:
                    os.remove(p)
            dist.barrier()

    best = max(history, key=lambda m: m["mrr"]) if history else None
    metrics = evaluate(model, test, hr_t, rt_h, device, rank, world)
    if rank == 0:
        print(f"test (final weights): {json.dumps(metrics)}; best valid: {best}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
