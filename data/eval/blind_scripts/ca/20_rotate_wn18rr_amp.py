"""RotatE on WN18RR with DDP + bf16 autocast.

Self-adversarial negative sampling, head and tail corruption alternating per
batch, filtered MRR/Hits@{1,3,10} on both directions.

    torchrun --standalone --nproc_per_node=4 20_rotate_wn18rr_amp.py --data data/wn18rr
"""
import argparse
import math
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler


class RotatE(nn.Module):
    def __init__(self, n_ent, n_rel, dim, gamma):
        super().__init__()
        self.gamma = gamma
        self.dim = dim
        self.rng = (gamma + 2.0) / dim
        self.entity = nn.Embedding(n_ent, 2 * dim)
        self.relation = nn.Embedding(n_rel, dim)
        nn.init.uniform_(self.entity.weight, -self.rng, self.rng)
        nn.init.uniform_(self.relation.weight, -self.rng, self.rng)

    def _complex_dist(self, a_re, a_im, b_re, b_im):
        return torch.sqrt((a_re - b_re) ** 2 + (a_im - b_im) ** 2 + 1e-10).sum(-1)

    def _phase(self, r):
        p = self.relation(r) / (self.rng / math.pi)
        return torch.cos(p), torch.sin(p)

    def forward(self, pos, neg, corrupt_tail: bool):
        h = self.entity(pos[:, 0])
        t = self.entity(pos[:, 2])
        c, s = self._phase(pos[:, 1])
        n_re, n_im = self.entity(neg).chunk(2, -1)
        h_re, h_im = h.chunk(2, -1)
        t_re, t_im = t.chunk(2, -1)
        q_re, q_im = h_re * c - h_im * s, h_re * s + h_im * c
        pos_d = self._complex_dist(q_re, q_im, t_re, t_im)
        if corrupt_tail:
            neg_d = self._complex_dist(q_re.unsqueeze(1), q_im.unsqueeze(1), n_re, n_im)
        else:
            # rotate candidate heads: n * r vs t
            nq_re = n_re * c.unsqueeze(1) - n_im * s.unsqueeze(1)
            nq_im = n_re * s.unsqueeze(1) + n_im * c.unsqueeze(1)
            neg_d = self._complex_dist(nq_re, nq_im, t_re.unsqueeze(1), t_im.unsqueeze(1))
        return self.gamma - pos_d, self.gamma - neg_d

    @torch.no_grad()
    def predict_tails(self, h, r):
        c, s = self._phase(r)
        h_re, h_im = self.entity(h).chunk(2, -1)
        q_re, q_im = (h_re * c - h_im * s).unsqueeze(1), (h_re * s + h_im * c).unsqueeze(1)
        e_re, e_im = self.entity.weight.chunk(2, -1)
        return self.gamma - self._complex_dist(q_re, q_im, e_re.unsqueeze(0), e_im.unsqueeze(0))

    @torch.no_grad()
    def predict_heads(self, r, t):
        # h * r = t  =>  h = t * conj(r)
        c, s = self._phase(r)
        t_re, t_im = self.entity(t).chunk(2, -1)
        q_re, q_im = (t_re * c + t_im * s).unsqueeze(1), (t_im * c - t_re * s).unsqueeze(1)
        e_re, e_im = self.entity.weight.chunk(2, -1)
        return self.gamma - self._complex_dist(q_re, q_im, e_re.unsqueeze(0), e_im.unsqueeze(0))


def load_split(d, name, e2i, r2i):
    with open(os.path.join(d, name)) as f:
        return np.array([[e2i[h], r2i[r], e2i[t]] for h, r, t in (l.split() for l in f)], dtype=np.int64)


@torch.no_grad()
def evaluate(model, triples, true_t, true_h, device, bs=32):
    rank, world = dist.get_rank(), dist.get_world_size()
    part = torch.from_numpy(triples[rank::world])
    tot = torch.zeros(5, dtype=torch.float64, device=device)
    for i in range(0, part.size(0), bs):
        b = part[i:i + bs].to(device)
        for side in ("tail", "head"):
            if side == "tail":
                sc = model.predict_tails(b[:, 0], b[:, 1]).float()
                gold = b[:, 2]
                known = [true_t[(h, r)] for h, r, _ in b.tolist()]
            else:
                sc = model.predict_heads(b[:, 1], b[:, 2]).float()
                gold = b[:, 0]
                known = [true_h[(r, t)] for _, r, t in b.tolist()]
            g = sc.gather(1, gold[:, None]).clone()
            for j, k in enumerate(known):
                sc[j, k] = -float("inf")
            sc.scatter_(1, gold[:, None], g)
            rk = (sc > g).sum(1).double() + 1
            tot[0] += (1 / rk).sum()
            tot[1] += (rk <= 1).sum()
            tot[2] += (rk <= 3).sum()
            tot[3] += (rk <= 10).sum()
            tot[4] += rk.numel()
    dist.all_reduce(tot)
    return {k: (tot[i] / tot[4]).item() for i, k in enumerate(["MRR", "H@1", "H@3", "H@10"])}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", default="data/wn18rr")
    ap.add_argument("--dim", type=int, default=500)
    ap.add_argument("--gamma", type=float, default=6.0)
    ap.add_argument("--alpha", type=float, default=0.5, help="adversarial temperature")
    ap.add_argument("--neg", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=512)
    ap.add_argument("--lr", type=float, default=5e-5)
    ap.add_argument("--epochs", type=int, default=300)
    ap.add_argument("--eval_every", type=int, default=25)
    ap.add_argument("--save", default="ckpt/rotate_wn18rr")
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    with open(os.path.join(args.data, "entities.dict")) as f:
        e2i = {n: int(i) for i, n in (l.split() for l in f)}
    with open(os.path.join(args.data, "relations.dict")) as f:
        r2i = {n: int(i) for i, n in (l.split() for l in f)}
    train = load_split(args.data, "train.txt", e2i, r2i)
    valid = load_split(args.data, "valid.txt", e2i, r2i)
    test = load_split(args.data, "test.txt", e2i, r2i)
    true_t, true_h = {}, {}
    for h, r, t in np.concatenate([train, valid, test]).tolist():
        true_t.setdefault((h, r), []).append(t)
        true_h.setdefault((r, t), []).append(h)

    ds = TensorDataset(torch.from_numpy(train))
    sampler = DistributedSampler(ds, shuffle=True, drop_last=True)
    loader = DataLoader(ds, batch_size=args.batch, sampler=sampler, drop_last=True,
                        num_workers=2, pin_memory=True)

    model = RotatE(len(e2i), len(r2i), args.dim, args.gamma).to(device)
    model = DDP(model, device_ids=[local_rank])
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    if rank == 0:
        os.makedirs(args.save, exist_ok=True)

    best, step = 0.0, 0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        acc = torch.zeros(2, device=device)
        for (x,) in loader:
            x = x.to(device, non_blocking=True)
            neg = torch.randint(len(e2i), (x.size(0), args.neg), device=device)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                ps, ns = model(x, neg, step % 2 == 0)
            ps, ns = ps.float(), ns.float()
            w = F.softmax(ns * args.alpha, dim=1).detach()
            loss = -0.5 * (F.logsigmoid(ps).mean() + (w * F.logsigmoid(-ns)).sum(1).mean())
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            step += 1
            acc += torch.stack([loss.detach(), torch.ones((), device=device)])
        dist.all_reduce(acc)
        if rank == 0:
            print(f"epoch {epoch} loss {(acc[0] / acc[1]).item():.4f} {time.time() - t0:.1f}s",
                  flush=True)

        if (epoch + 1) % args.eval_every == 0:
            model.eval()
            m = evaluate(model, valid, true_t, true_h, device)
            if rank == 0:
                print(f"valid {m}", flush=True)
                if m["MRR"] > best:
                    best = m["MRR"]
                    torch.save(model.module.state_dict(), os.path.join(args.save, "best.pt"))
            dist.barrier()

    model.module.load_state_dict(torch.load(os.path.join(args.save, "best.pt"),
                                            map_location=device))
    m = evaluate(model, test, true_t, true_h, device)
    if rank == 0:
        print(f"test {m}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
