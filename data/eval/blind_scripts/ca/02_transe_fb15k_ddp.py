#!/usr/bin/env python
"""TransE on FB15k-237 with DistributedDataParallel.

    torchrun --standalone --nproc_per_node=8 02_transe_fb15k_ddp.py \
        --data_dir data/FB15k-237 --global_batch 8192

--global_batch is split across ranks, so lr / schedule do not need to change
with the number of GPUs.
"""
import argparse
import os
import time
from collections import defaultdict

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter


class TripleDataset(Dataset):
    def __init__(self, triples):
        self.triples = triples

    def __len__(self):
        return self.triples.size(0)

    def __getitem__(self, i):
        return self.triples[i]


def load_split(path, ent2id, rel2id):
    rows = []
    with open(path) as f:
        for line in f:
            h, r, t = line.rstrip("\n").split("\t")
            rows.append((ent2id[h], rel2id[r], ent2id[t]))
    return torch.tensor(rows, dtype=torch.long)


def build_vocab(paths):
    ents, rels = set(), set()
    for p in paths:
        with open(p) as f:
            for line in f:
                h, r, t = line.rstrip("\n").split("\t")
                ents.update((h, t))
                rels.add(r)
    ent2id = {e: i for i, e in enumerate(sorted(ents))}
    rel2id = {r: i for i, r in enumerate(sorted(rels))}
    return ent2id, rel2id


class TransE(nn.Module):
    def __init__(self, n_ent, n_rel, dim, p_norm=1, margin=6.0):
        super().__init__()
        self.ent = nn.Embedding(n_ent, dim)
        self.rel = nn.Embedding(n_rel, dim)
        bound = 6.0 / dim ** 0.5
        nn.init.uniform_(self.ent.weight, -bound, bound)
        nn.init.uniform_(self.rel.weight, -bound, bound)
        with torch.no_grad():
            self.rel.weight.div_(self.rel.weight.norm(p=2, dim=1, keepdim=True))
        self.p = p_norm
        self.margin = margin

    def _dist(self, h, r, t):
        return (h + r - t).norm(p=self.p, dim=-1)

    def forward(self, pos, neg_ent, corrupt_head):
        h = self.ent(pos[:, 0])
        r = self.rel(pos[:, 1])
        t = self.ent(pos[:, 2])
        d_pos = self._dist(h, r, t)
        n = self.ent(neg_ent)                       # [B, K, d]
        h_n = torch.where(corrupt_head[:, None, None], n, h.unsqueeze(1))
        t_n = torch.where(corrupt_head[:, None, None], t.unsqueeze(1), n)
        d_neg = self._dist(h_n, r.unsqueeze(1), t_n)
        return F.relu(self.margin + d_pos.unsqueeze(1) - d_neg).mean()

    @torch.no_grad()
    def rank_scores(self, h_idx, r_idx, predict_tail=True):
        e = self.ent.weight
        r = self.rel(r_idx)
        if predict_tail:
            q = self.ent(h_idx) + r
            return -torch.cdist(q, e, p=self.p)
        q = self.ent(h_idx) - r   # here h_idx holds the known tail
        return -torch.cdist(q, e, p=self.p)


@torch.no_grad()
def filtered_ranks(model, triples, filt_t, filt_h, device, bs):
    out = []
    for s in range(0, triples.size(0), bs):
        b = triples[s:s + bs].to(device)
        for tail_side in (True, False):
            if tail_side:
                scores = model.rank_scores(b[:, 0], b[:, 1], True)
                target = b[:, 2]
                keys = [(h, r) for h, r in b[:, :2].tolist()]
                filt = filt_t
            else:
                scores = model.rank_scores(b[:, 2], b[:, 1], False)
                target = b[:, 0]
                keys = [(t, r) for t, r in b[:, [2, 1]].tolist()]
                filt = filt_h
            tgt = scores.gather(1, target[:, None])
            for i, k in enumerate(keys):
                scores[i, list(filt[k])] = -float("inf")
            scores.scatter_(1, target[:, None], tgt)
            out.append((scores > tgt).sum(1) + 1)
    return torch.cat(out)


def gather_ranks(local, world):
    # shards can differ in length by one: pad to the max before all_gather
    n = torch.tensor([local.numel()], device=local.device)
    sizes = [torch.zeros_like(n) for _ in range(world)]
    dist.all_gather(sizes, n)
    max_n = max(int(s) for s in sizes)
    padded = torch.zeros(max_n, dtype=local.dtype, device=local.device)
    padded[:local.numel()] = local
    bufs = [torch.zeros_like(padded) for _ in range(world)]
    dist.all_gather(bufs, padded)
    return torch.cat([b[:int(s)] for b, s in zip(bufs, sizes)])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data_dir", required=True)
    ap.add_argument("--dim", type=int, default=200)
    ap.add_argument("--global_batch", type=int, default=8192)
    ap.add_argument("--num_neg", type=int, default=64)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--epochs", type=int, default=300)
    ap.add_argument("--eval_every", type=int, default=25)
    ap.add_argument("--ckpt_dir", default="checkpoints/transe")
    ap.add_argument("--resume", action="store_true")
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{local_rank}")
    assert args.global_batch % world == 0
    per_rank_bs = args.global_batch // world

    files = [os.path.join(args.data_dir, f"{s}.txt") for s in ("train", "valid", "test")]
    ent2id, rel2id = build_vocab(files)
    train, valid, test = (load_split(f, ent2id, rel2id) for f in files)
    filt_t, filt_h = defaultdict(set), defaultdict(set)
    for h, r, t in torch.cat([train, valid, test]).tolist():
        filt_t[(h, r)].add(t)
        filt_h[(t, r)].add(h)

    ds = TripleDataset(train)
    sampler = DistributedSampler(ds, num_replicas=world, rank=rank, shuffle=True,
                                 seed=17, drop_last=True)
    loader = DataLoader(ds, batch_size=per_rank_bs, sampler=sampler, num_workers=2,
                        pin_memory=True, drop_last=True, persistent_workers=True)

    model = TransE(len(ent2id), len(rel2id), args.dim).to(device)
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    start_epoch, best = 0, 0.0
    ckpt_path = os.path.join(args.ckpt_dir, "last.pt")
    if args.resume and os.path.exists(ckpt_path):
        ckpt = torch.load(ckpt_path, map_location=device)
        model.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["opt"])
        start_epoch, best = ckpt["epoch"] + 1, ckpt["best"]
    ddp = DDP(model, device_ids=[local_rank], output_device=local_rank)

    writer = SummaryWriter(os.path.join(args.ckpt_dir, "tb")) if rank == 0 else None
    if rank == 0:
        os.makedirs(args.ckpt_dir, exist_ok=True)

    n_ent = len(ent2id)
    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)
        ddp.train()
        t0 = time.time()
        loss_sum = torch.zeros(2, device=device)
        for batch in loader:
            batch = batch.to(device, non_blocking=True)
            neg = torch.randint(n_ent, (batch.size(0), args.num_neg), device=device)
            corrupt_head = torch.rand(batch.size(0), device=device) < 0.5
            loss = ddp(batch, neg, corrupt_head)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            with torch.no_grad():
                model.ent.weight.data.renorm_(p=2, dim=0, maxnorm=1.0)
            loss_sum[0] += loss.detach()
            loss_sum[1] += 1
        dist.all_reduce(loss_sum)
        if rank == 0:
            writer.add_scalar("train/loss", (loss_sum[0] / loss_sum[1]).item(), epoch)
            print(f"epoch {epoch} loss {(loss_sum[0] / loss_sum[1]).item():.4f} "
                  f"{time.time() - t0:.1f}s", flush=True)

        if (epoch + 1) % args.eval_every == 0 or epoch + 1 == args.epochs:
            ddp.eval()
            local = filtered_ranks(model, valid[rank::world], filt_t, filt_h, device, 128)
            ranks = gather_ranks(local, world).float()
            mrr = (1.0 / ranks).mean().item()
            h10 = (ranks <= 10).float().mean().item()
            if rank == 0:
                writer.add_scalar("valid/mrr", mrr, epoch)
                writer.add_scalar("valid/hits10", h10, epoch)
                print(f"  valid MRR {mrr:.4f} H@10 {h10:.4f}", flush=True)
                state = {"model": model.state_dict(), "opt": opt.state_dict(),
                         "epoch": epoch, "best": max(best, mrr)}
                torch.save(state, ckpt_path + ".tmp")
                os.replace(ckpt_path + ".tmp", ckpt_path)
                if mrr > best:
                    torch.save(model.state_dict(), os.path.join(args.ckpt_dir, "best.pt"))
            best = max(best, mrr)
            dist.barrier()

    model.load_state_dict(torch.load(os.path.join(args.ckpt_dir, "best.pt"),
                                     map_location=device))
    local = filtered_ranks(model, test[rank::world], filt_t, filt_h, device, 128)
    ranks = gather_ranks(local, world).float()
    if rank == 0:
        print(f"TEST MRR {(1.0 / ranks).mean().item():.4f} "
              f"H@1 {(ranks <= 1).float().mean().item():.4f} "
              f"H@10 {(ranks <= 10).float().mean().item():.4f}")
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
