"""ComplEx on OpenKE-format benchmarks (train2id.txt / valid2id.txt / test2id.txt).

OpenKE files: first line is the number of triples, then "head tail relation"
integer ids per line.

    torchrun --nproc_per_node=4 18_complex_openke_ids.py --in_path benchmarks/WN18RR/ --dim 500
"""
import argparse
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


def read_openke(path):
    with open(path) as f:
        n = int(f.readline())
        arr = np.loadtxt(f, dtype=np.int64, max_rows=n).reshape(-1, 3)
    # reorder (h, t, r) -> (h, r, t)
    return arr[:, [0, 2, 1]]


class NegSampling(Dataset):
    def __init__(self, triples, num_ent, num_neg):
        self.x = torch.from_numpy(triples)
        self.num_ent = num_ent
        self.num_neg = num_neg

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        pos = self.x[i]
        neg = pos.repeat(self.num_neg, 1)
        rand = torch.randint(self.num_ent, (self.num_neg,))
        side = torch.rand(self.num_neg) < 0.5
        neg[side, 0] = rand[side]
        neg[~side, 2] = rand[~side]
        return pos, neg


class ComplEx(nn.Module):
    def __init__(self, num_ent, num_rel, dim, lmbda):
        super().__init__()
        self.ent_re = nn.Embedding(num_ent, dim)
        self.ent_im = nn.Embedding(num_ent, dim)
        self.rel_re = nn.Embedding(num_rel, dim)
        self.rel_im = nn.Embedding(num_rel, dim)
        for e in (self.ent_re, self.ent_im, self.rel_re, self.rel_im):
            nn.init.xavier_uniform_(e.weight)
        self.lmbda = lmbda

    def _score(self, x):
        h_re, h_im = self.ent_re(x[..., 0]), self.ent_im(x[..., 0])
        t_re, t_im = self.ent_re(x[..., 2]), self.ent_im(x[..., 2])
        r_re, r_im = self.rel_re(x[..., 1]), self.rel_im(x[..., 1])
        return (h_re * t_re * r_re + h_im * t_im * r_re
                + h_re * t_im * r_im - h_im * t_re * r_im).sum(-1)

    def forward(self, pos, neg):
        sp = self._score(pos)
        sn = self._score(neg)
        loss = F.softplus(-sp).mean() + F.softplus(sn).mean()
        reg = sum(e(pos[:, i]).pow(2).mean() for e, i in
                  ((self.ent_re, 0), (self.ent_im, 0), (self.ent_re, 2), (self.ent_im, 2),
                   (self.rel_re, 1), (self.rel_im, 1)))
        return loss + self.lmbda * reg

    @torch.no_grad()
    def tail_scores(self, h, r):
        h_re, h_im = self.ent_re(h), self.ent_im(h)
        r_re, r_im = self.rel_re(r), self.rel_im(r)
        a = h_re * r_re - h_im * r_im
        b = h_im * r_re + h_re * r_im
        return a @ self.ent_re.weight.t() + b @ self.ent_im.weight.t()

    @torch.no_grad()
    def head_scores(self, r, t):
        t_re, t_im = self.ent_re(t), self.ent_im(t)
        r_re, r_im = self.rel_re(r), self.rel_im(r)
        a = t_re * r_re + t_im * r_im
        b = t_im * r_re - t_re * r_im
        return a @ self.ent_re.weight.t() + b @ self.ent_im.weight.t()


def true_index(triples):
    tails, heads = {}, {}
    for h, r, t in triples.tolist():
        tails.setdefault((h, r), []).append(t)
        heads.setdefault((r, t), []).append(h)
    return tails, heads


@torch.no_grad()
def link_prediction(model, triples, tails, heads, device, rank, world, bs=100):
    part = torch.from_numpy(triples[rank::world])
    acc = torch.zeros(5, dtype=torch.float64, device=device)
    for s in range(0, len(part), bs):
        b = part[s:s + bs].to(device)
        for side in ("tail", "head"):
            if side == "tail":
                sc, gold = model.tail_scores(b[:, 0], b[:, 1]), b[:, 2]
                filt = [tails[(h, r)] for h, r, _ in b.tolist()]
            else:
                sc, gold = model.head_scores(b[:, 1], b[:, 2]), b[:, 0]
                filt = [heads[(r, t)] for _, r, t in b.tolist()]
            g = sc.gather(1, gold[:, None]).clone()
            for i, f in enumerate(filt):
                sc[i, f] = -float("inf")
            sc.scatter_(1, gold[:, None], g)
            rk = (sc > g).sum(1).double() + 1
            acc[0] += (1 / rk).sum()
            acc[1] += rk.sum()
            acc[2] += (rk <= 1).sum()
            acc[3] += (rk <= 10).sum()
            acc[4] += rk.numel()
    dist.all_reduce(acc)
    n = acc[4]
    return {"MRR": (acc[0] / n).item(), "MR": (acc[1] / n).item(),
            "Hit@1": (acc[2] / n).item(), "Hit@10": (acc[3] / n).item()}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--in_path", default="benchmarks/WN18RR/")
    ap.add_argument("--dim", type=int, default=500)
    ap.add_argument("--lmbda", type=float, default=0.05)
    ap.add_argument("--neg", type=int, default=25)
    ap.add_argument("--batch", type=int, default=512)
    ap.add_argument("--lr", type=float, default=0.5)
    ap.add_argument("--epochs", type=int, default=1000)
    ap.add_argument("--valid_every", type=int, default=50)
    ap.add_argument("--ckpt", default="checkpoint/complex_wn18rr.pt")
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    train = read_openke(os.path.join(args.in_path, "train2id.txt"))
    valid = read_openke(os.path.join(args.in_path, "valid2id.txt"))
    test = read_openke(os.path.join(args.in_path, "test2id.txt"))
    num_ent = int(max(train[:, 0].max(), train[:, 2].max())) + 1
    num_rel = int(train[:, 1].max()) + 1
    tails, heads = true_index(np.concatenate([train, valid, test]))
    if rank == 0:
        print(f"entities {num_ent} relations {num_rel} train {len(train)} valid {len(valid)} "
              f"test {len(test)}", flush=True)

    ds = NegSampling(train, num_ent, args.neg)
    sampler = DistributedSampler(ds, shuffle=True)
    loader = DataLoader(ds, batch_size=args.batch, sampler=sampler, num_workers=4, pin_memory=True)

    model = ComplEx(num_ent, num_rel, args.dim, args.lmbda).to(device)
    ddp = DDP(model, device_ids=[local_rank])
    opt = torch.optim.Adagrad(ddp.parameters(), lr=args.lr)

    best = 0.0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        t0 = time.time()
        tot = torch.zeros(2, device=device)
        for pos, neg in loader:
            pos, neg = pos.to(device, non_blocking=True), neg.to(device, non_blocking=True)
            loss = ddp(pos, neg)
            opt.zero_grad()
            loss.backward()
            opt.step()
            tot += torch.stack([loss.detach(), torch.ones((), device=device)])
        dist.all_reduce(tot)
        if rank == 0 and epoch % 10 == 0:
            print(f"epoch {epoch} loss {(tot[0] / tot[1]).item():.5f} {time.time() - t0:.1f}s",
                  flush=True)

        if (epoch + 1) % args.valid_every == 0:
            model.eval()
            res = link_prediction(model, valid, tails, heads, device, rank, world)
            model.train()
            if rank == 0:
                print(f"valid @ {epoch}: {res}", flush=True)
                if res["MRR"] > best:
                    best = res["MRR"]
                    os.makedirs(os.path.dirname(args.ckpt), exist_ok=True)
                    torch.save({"model": model.state_dict(), "epoch": epoch}, args.ckpt)
            dist.barrier()

    ck = torch.load(args.ckpt, map_location=device)
    model.load_state_dict(ck["model"])
    res = link_prediction(model, test, tails, heads, device, rank, world)
    if rank == 0:
        print(f"test (epoch {ck['epoch']}): {res}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
