"""IS2RE direct relaxed-energy regression on OC20 with a compact element vocabulary.

Only the elements that occur in the training data get their own embedding
row (rare ones share an "other" row); per-element reference energies are
learned as a second embedding.

    torchrun --nproc_per_node=8 08_oc20_is2re_element_vocab.py \
        --train /datasets/oc20/is2re/all/train/data.lmdb --val /datasets/oc20/is2re/all/val_id/data.lmdb
"""
import argparse
import math
import os
import pickle

import lmdb
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import Dataset, Subset
from torch.utils.data.distributed import DistributedSampler
from torch_geometric.loader import DataLoader
from torch_geometric.utils import scatter


class IS2RELmdb(Dataset):
    def __init__(self, path):
        self.path = path
        env = self._connect()
        self.length = env.stat()["entries"]
        env.close()
        self.env = None

    def _connect(self):
        return lmdb.open(self.path, subdir=False, readonly=True, lock=False, readahead=False,
                         meminit=False, max_readers=1)

    def __len__(self):
        return self.length

    def __getitem__(self, idx):
        if self.env is None:
            self.env = self._connect()
        with self.env.begin() as txn:
            data = pickle.loads(txn.get(str(idx).encode("ascii")))
        data.atomic_numbers = data.atomic_numbers.long()
        return data


def scan_elements(path, indices):
    counts = np.zeros(100, dtype=np.int64)
    env = lmdb.open(path, subdir=False, readonly=True, lock=False, readahead=False, meminit=False)
    with env.begin() as txn:
        for i in indices:
            z = pickle.loads(txn.get(str(i).encode("ascii"))).atomic_numbers.long().numpy()
            counts += np.bincount(z, minlength=100)
    env.close()
    return counts


class GaussianSmearing(nn.Module):
    def __init__(self, cutoff, n):
        super().__init__()
        self.register_buffer("offset", torch.linspace(0, cutoff, n))
        self.coeff = -0.5 / (cutoff / (n - 1)) ** 2

    def forward(self, d):
        return torch.exp(self.coeff * (d.unsqueeze(-1) - self.offset) ** 2)


class Block(nn.Module):
    def __init__(self, hidden, n_gauss, cutoff):
        super().__init__()
        self.cutoff = cutoff
        self.filt = nn.Sequential(nn.Linear(n_gauss, hidden), nn.SiLU(), nn.Linear(hidden, hidden))
        self.pre = nn.Linear(hidden, hidden, bias=False)
        self.post = nn.Sequential(nn.Linear(hidden, hidden), nn.SiLU(), nn.Linear(hidden, hidden))
        self.norm = nn.LayerNorm(hidden)

    def forward(self, h, edge_index, d, g):
        src, dst = edge_index
        env = 0.5 * (torch.cos(math.pi * d / self.cutoff) + 1.0)
        msg = self.pre(h)[src] * self.filt(g) * env.unsqueeze(-1)
        return self.norm(h + self.post(scatter(msg, dst, dim=0, dim_size=h.size(0))))


class IS2REModel(nn.Module):
    def __init__(self, z_to_index, num_slots, hidden=256, blocks=4, n_gauss=64, cutoff=6.0):
        super().__init__()
        self.register_buffer("z_to_index", z_to_index)
        self.embed = nn.Embedding(num_slots, hidden)
        self.tag_embed = nn.Embedding(3, hidden)
        self.atomref = nn.Embedding(num_slots, 1)
        self.smear = GaussianSmearing(cutoff, n_gauss)
        self.blocks = nn.ModuleList([Block(hidden, n_gauss, cutoff) for _ in range(blocks)])
        self.out = nn.Sequential(nn.Linear(hidden, hidden // 2), nn.SiLU(), nn.Linear(hidden // 2, 1))

    def forward(self, data):
        idx = self.z_to_index[data.atomic_numbers]
        src, dst = data.edge_index
        shift = (data.cell_offsets.unsqueeze(1).float() @ data.cell[data.batch[src]]).squeeze(1)
        d = (data.pos[src] - data.pos[dst] + shift).norm(dim=-1)
        g = self.smear(d)
        h = self.embed(idx) + self.tag_embed(data.tags.long())
        for blk in self.blocks:
            h = blk(h, data.edge_index, d, g)
        e = self.out(h).squeeze(-1) + self.atomref(idx).squeeze(-1)
        return scatter(e, data.batch, dim=0, dim_size=data.num_graphs)


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    err = torch.zeros(3, dtype=torch.float64, device=device)
    for data in loader:
        data = data.to(device)
        pred = model(data)
        diff = (pred - data.y_relaxed).abs()
        err[0] += diff.sum()
        err[1] += (diff < 0.02).sum()
        err[2] += data.num_graphs
    dist.all_reduce(err)
    return (err[0] / err[2]).item(), (err[1] / err[2]).item()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--train", required=True)
    ap.add_argument("--val", required=True)
    ap.add_argument("--out", default="/checkpoint/is2re_vocab")
    ap.add_argument("--min-count", type=int, default=50)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--lr", type=float, default=5e-4)
    ap.add_argument("--epochs", type=int, default=20)
    ap.add_argument("--workers", type=int, default=8)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(0)

    train_set, val_set = IS2RELmdb(args.train), IS2RELmdb(args.val)
    sampler = DistributedSampler(train_set, shuffle=True, seed=0)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler,
                              num_workers=args.workers, pin_memory=True, persistent_workers=True)
    val_loader = DataLoader(Subset(val_set, range(rank, len(val_set), world)), batch_size=64,
                            num_workers=args.workers)

    # One pass over the training structures to count elements.
    counts = scan_elements(args.train, list(sampler))
    frequent = np.nonzero(counts >= args.min_count)[0]
    z_to_index = torch.full((100,), len(frequent), dtype=torch.long)
    z_to_index[torch.as_tensor(frequent)] = torch.arange(len(frequent))
    if rank == 0:
        print(f"{len(frequent)} frequent elements, others share slot {len(frequent)}", flush=True)

    model = IS2REModel(z_to_index, num_slots=len(frequent) + 1).to(device)
    model = DDP(model, device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=1e-4)
    steps = args.epochs * len(train_loader)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, s / 2000) * 0.5 * (1 + math.cos(math.pi * min(s, steps) / steps)))

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        running = torch.zeros(2, device=device)
        for it, data in enumerate(train_loader):
            data = data.to(device, non_blocking=True)
            pred = model(data)
            loss = nn.functional.l1_loss(pred, data.y_relaxed)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 20.0)
            opt.step()
            sched.step()
            running += torch.stack([loss.detach() * data.num_graphs, torch.tensor(float(data.num_graphs), device=device)])
        dist.all_reduce(running)
        mae, ewt = evaluate(model.module, val_loader, device)
        if rank == 0:
            print(f"epoch {epoch}: train MAE {running[0] / running[1]:.4f} eV  val MAE {mae:.4f} eV  "
                  f"EwT {100 * ewt:.2f}%", flush=True)
            torch.save({"model": model.module.state_dict(), "epoch": epoch, "opt": opt.state_dict()},
                       os.path.join(args.out, f"epoch_{epoch:03d}.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
