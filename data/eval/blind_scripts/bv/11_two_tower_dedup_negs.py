"""Video retrieval two-tower model, sampled softmax over the global batch.

Popular items show up many times in one batch; each rank encodes every distinct
item once and shares the item embeddings with the other ranks, so every user is
scored against all distinct items of the global batch (no duplicate negatives).

    torchrun --nproc_per_node=8 11_two_tower_dedup_negs.py --epochs 3
"""
import argparse
import logging
import os
import time

import numpy as np
import pyarrow.dataset as ds
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

logger = logging.getLogger("tt")
SEQ = 30


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--train", default="/mnt/data/video_rec/clicks/train")
    p.add_argument("--valid", default="/mnt/data/video_rec/clicks/valid")
    p.add_argument("--n-users", type=int, default=50_000_000)
    p.add_argument("--n-items", type=int, default=4_000_000)
    p.add_argument("--n-authors", type=int, default=800_000)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--tau", type=float, default=0.05)
    p.add_argument("--batch", type=int, default=4096)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--out", default="/mnt/data/video_rec/models/tt_dedup")
    return p.parse_args()


class ClickLog(Dataset):
    def __init__(self, path):
        t = ds.dataset(path, format="parquet").to_table(
            columns=["user_id", "seq", "item_id", "author_id"])
        self.user = t["user_id"].to_numpy()
        self.item = t["item_id"].to_numpy()
        self.author = t["author_id"].to_numpy()
        seqs = t["seq"].to_pylist()
        self.seq = np.zeros((len(seqs), SEQ), dtype=np.int64)
        for i, s in enumerate(seqs):
            s = s[-SEQ:]
            self.seq[i, SEQ - len(s):] = s

    def __len__(self):
        return len(self.user)

    def __getitem__(self, i):
        return self.user[i], self.seq[i], self.item[i], self.author[i]


class UserTower(nn.Module):
    def __init__(self, n_users, n_items, dim):
        super().__init__()
        self.uid = nn.Embedding(n_users, dim)
        self.seq = nn.EmbeddingBag(n_items, dim, mode="mean", padding_idx=0)
        self.mlp = nn.Sequential(nn.Linear(2 * dim, 256), nn.ReLU(), nn.Linear(256, dim))

    def forward(self, uid, seq):
        return F.normalize(self.mlp(torch.cat([self.uid(uid), self.seq(seq)], -1)), dim=-1)


class ItemTower(nn.Module):
    def __init__(self, n_items, n_authors, dim):
        super().__init__()
        self.iid = nn.Embedding(n_items, dim)
        self.aid = nn.Embedding(n_authors, dim)
        self.mlp = nn.Sequential(nn.Linear(2 * dim, 256), nn.ReLU(), nn.Linear(256, dim))

    def forward(self, iid, aid):
        return F.normalize(self.mlp(torch.cat([self.iid(iid), self.aid(aid)], -1)), dim=-1)


class Retrieval(nn.Module):
    def __init__(self, a):
        super().__init__()
        self.user = UserTower(a.n_users, a.n_items, a.dim)
        self.item = ItemTower(a.n_items, a.n_authors, a.dim)

    def forward(self, uid, seq, iid, aid):
        return self.user(uid, seq), self.item(iid, aid)


class AllGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.n = x.size(0)
        out = [torch.empty_like(x) for _ in range(dist.get_world_size())]
        dist.all_gather(out, x)
        return torch.cat(out)

    @staticmethod
    def backward(ctx, g):
        g = g.contiguous()
        dist.all_reduce(g)
        r = dist.get_rank()
        return g[r * ctx.n:(r + 1) * ctx.n]


def global_softmax_loss(u, item_ids, uniq_emb, uniq_ids, inverse, tau):
    rank = dist.get_rank()
    all_emb = AllGather.apply(uniq_emb)
    ids_list = [torch.empty_like(uniq_ids) for _ in range(dist.get_world_size())]
    dist.all_gather(ids_list, uniq_ids)
    offset = sum(t.size(0) for t in ids_list[:rank])
    all_ids = torch.cat(ids_list)
    logits = u @ all_emb.T / tau
    target = inverse + offset
    # the same item may also be a distinct item on another rank
    same = item_ids.unsqueeze(1) == all_ids.unsqueeze(0)
    same[torch.arange(len(target), device=u.device), target] = False
    return F.cross_entropy(logits.masked_fill(same, -1e4), target)


@torch.no_grad()
def valid_loss(model, loader, device, tau):
    model.eval()
    tot = torch.zeros(2, device=device, dtype=torch.float64)
    for uid, seq, iid, aid in loader:
        u, v = model(uid.to(device), seq.to(device), iid.to(device), aid.to(device))
        logits = u @ v.T / tau
        tot[0] += F.cross_entropy(logits, torch.arange(len(uid), device=device), reduction="sum").double()
        tot[1] += len(uid)
    dist.all_reduce(tot)
    model.train()
    return (tot[0] / tot[1]).item()


def main():
    a = parse()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARN,
                        format="%(asctime)s %(name)s %(message)s")

    train, valid = ClickLog(a.train), ClickLog(a.valid)
    sampler = DistributedSampler(train, shuffle=True, drop_last=True)
    tl = DataLoader(train, batch_size=a.batch, sampler=sampler, num_workers=8, pin_memory=True, drop_last=True)
    vl = DataLoader(valid, batch_size=a.batch, sampler=DistributedSampler(valid, shuffle=False, drop_last=True),
                    num_workers=4, pin_memory=True, drop_last=True)

    model = DDP(Retrieval(a).to(device), device_ids=[local_rank])
    opt = torch.optim.Adam(model.parameters(), lr=a.lr)
    if rank == 0:
        os.makedirs(a.out, exist_ok=True)

    for epoch in range(a.epochs):
        sampler.set_epoch(epoch)
        t0 = time.time()
        for step, (uid, seq, iid, aid) in enumerate(tl):
            uid, seq = uid.to(device, non_blocking=True), seq.to(device, non_blocking=True)
            iid, aid = iid.to(device, non_blocking=True), aid.to(device, non_blocking=True)

            uniq_ids, first = np.unique(iid.cpu().numpy(), return_index=True)
            uniq_ids = torch.from_numpy(uniq_ids).to(device)
            inverse = torch.searchsorted(uniq_ids, iid)
            uniq_aid = aid[torch.from_numpy(first).to(device)]

            u, v = model(uid, seq, uniq_ids, uniq_aid)
            loss = global_softmax_loss(u, iid, v, uniq_ids, inverse, a.tau)

            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            if step % 200 == 0:
                logger.info("epoch %d step %d loss %.4f distinct items %d (%.0fs)",
                            epoch, step, loss.item(), uniq_ids.numel(), time.time() - t0)

        vloss = valid_loss(model, vl, device, a.tau)
        logger.info("epoch %d valid in-batch loss %.4f", epoch, vloss)
        if rank == 0:
            torch.save({"model": model.module.state_dict(), "epoch": epoch, "valid_loss": vloss},
                       os.path.join(a.out, f"tt_e{epoch}.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
