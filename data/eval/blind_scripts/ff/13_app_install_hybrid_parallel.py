"""App-install prediction: hybrid parallel DLRM written without TorchRec.

* large id tables: table-wise model parallel (one owner rank per table),
  exchanged with all-to-all of pooled embeddings
* small tables + MLPs: replicated, DDP

torchrun --nnodes=$NNODES --node_rank=$NODE_RANK --nproc_per_node=8 \
    --master_addr=$MASTER_ADDR --master_port=29500 13_app_install_hybrid_parallel.py --cfg cfg/install_v7.json
"""
import argparse
import json
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

DEFAULT_CFG = {
    "train": "/data/installs/train",
    "val": "/data/installs/val",
    "ckpt": "/shared/ckpt/install_v7/latest.pt",
    "large_tables": {"device_id": 90_000_000, "app_id": 4_000_000, "publisher_id": 2_500_000,
                     "creative_id": 6_000_000, "ip_prefix": 16_000_000},
    "small_tables": {"country": 256, "os": 8, "os_version": 600, "carrier": 2_000, "ad_format": 12,
                     "hour": 24},
    "num_dense": 10,
    "dim": 48,
    "batch_size": 4096,
    "epochs": 3,
    "lr": 1e-3,
    "sparse_lr": 0.05,
}


class InstallShards(Dataset):
    def __init__(self, root, large, small):
        self.large = np.load(os.path.join(root, "large_ids.npy"), mmap_mode="r")   # [N, len(large)]
        self.small = np.load(os.path.join(root, "small_ids.npy"), mmap_mode="r")   # [N, len(small)]
        self.dense = np.load(os.path.join(root, "dense.npy"), mmap_mode="r")
        self.label = np.load(os.path.join(root, "label.npy"), mmap_mode="r")
        assert self.large.shape[1] == len(large) and self.small.shape[1] == len(small)

    def __len__(self):
        return len(self.label)

    def __getitem__(self, i):
        return (torch.from_numpy(self.large[i].astype(np.int64)), torch.from_numpy(self.small[i].astype(np.int64)),
                torch.from_numpy(self.dense[i].astype(np.float32)), torch.tensor(float(self.label[i])))


class AllToAllPooled(torch.autograd.Function):
    @staticmethod
    def forward(ctx, world_size, batch, counts, *send):
        ctx.world_size, ctx.batch, ctx.counts = world_size, batch, counts
        dim = send[0].size(-1)
        recv = [send[0].new_empty(batch, counts[r], dim) for r in range(world_size)]
        dist.all_to_all(recv, [s.contiguous() for s in send])
        return tuple(recv)

    @staticmethod
    def backward(ctx, *grads):
        me = dist.get_rank()
        dim = grads[0].size(-1)
        back = [grads[0].new_empty(ctx.batch, ctx.counts[me], dim) for _ in range(ctx.world_size)]
        dist.all_to_all(back, [g.contiguous() for g in grads])
        return (None, None, None) + tuple(b / ctx.world_size for b in back)


class LargeTables(nn.Module):
    def __init__(self, sizes, dim, rank, world_size, device):
        super().__init__()
        names = list(sizes)
        self.owner = {n: i % world_size for i, n in enumerate(names)}
        self.owned = [[j for j, n in enumerate(names) if self.owner[n] == r] for r in range(world_size)]
        self.counts = [len(o) for o in self.owned]
        self.rank, self.world_size, self.dim = rank, world_size, dim
        self.tables = nn.ModuleDict({
            names[j]: nn.EmbeddingBag(sizes[names[j]], dim, mode="sum", sparse=True, device=device)
            for j in self.owned[rank]
        })
        self.names = names
        order = [j for o in self.owned for j in o]
        self.inverse = [order.index(j) for j in range(len(names))]

    def forward(self, ids):
        b = ids.size(0)
        all_ids = ids.new_empty(self.world_size * b, ids.size(1))
        dist.all_gather_into_tensor(all_ids, ids.contiguous())
        if self.counts[self.rank]:
            local = torch.stack([self.tables[self.names[j]](all_ids[:, j:j + 1]) for j in self.owned[self.rank]], 1)
        else:
            # no table here, but this rank still has to take part in the backward all-to-all
            local = torch.zeros(self.world_size * b, 0, self.dim, device=ids.device,
                                requires_grad=torch.is_grad_enabled())
        send = local.split(b, dim=0)
        recv = AllToAllPooled.apply(self.world_size, b, self.counts, *send)
        pooled = torch.cat(recv, dim=1)
        return pooled[:, self.inverse]


class DenseNet(nn.Module):
    def __init__(self, small_sizes, n_large, num_dense, dim):
        super().__init__()
        self.small = nn.ModuleList([nn.Embedding(n, dim) for n in small_sizes.values()])
        self.bottom = nn.Sequential(nn.Linear(num_dense, 128), nn.ReLU(), nn.Linear(128, dim))
        n_fields = n_large + len(small_sizes) + 1
        self.top = nn.Sequential(
            nn.Linear(n_fields * dim + n_fields * (n_fields - 1) // 2, 768), nn.ReLU(),
            nn.Linear(768, 256), nn.ReLU(), nn.Linear(256, 1),
        )

    def forward(self, large_emb, small_ids, dense):
        small = torch.stack([e(small_ids[:, i]) for i, e in enumerate(self.small)], 1)
        fields = torch.cat([large_emb, small, self.bottom(dense)[:, None]], 1)
        n = fields.size(1)
        iu = torch.triu_indices(n, n, 1, device=fields.device)
        inter = torch.bmm(fields, fields.transpose(1, 2))[:, iu[0], iu[1]]
        return self.top(torch.cat([fields.flatten(1), inter], 1)).squeeze(1)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cfg", default=None)
    ap.add_argument("--resume", action="store_true")
    args = ap.parse_args()
    cfg = dict(DEFAULT_CFG)
    if args.cfg:
        cfg.update(json.load(open(args.cfg)))

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()

    large = LargeTables(cfg["large_tables"], cfg["dim"], rank, world, device)
    dense_net = DenseNet(cfg["small_tables"], len(cfg["large_tables"]), cfg["num_dense"], cfg["dim"]).to(device)

    start_epoch = 0
    shard_path = cfg["ckpt"].replace(".pt", f".tables.rank{rank}-of-{world}.pt")
    if args.resume and os.path.exists(cfg["ckpt"]):
        ckpt = torch.load(cfg["ckpt"], map_location=device)
        dense_net.load_state_dict(ckpt["dense"])
        large.load_state_dict(torch.load(shard_path, map_location=device))
        start_epoch = ckpt["epoch"] + 1

    dense = DDP(dense_net, device_ids=[local_rank])
    sparse_opt = torch.optim.SparseAdam(list(large.parameters()), lr=cfg["sparse_lr"])
    dense_opt = torch.optim.AdamW(dense.parameters(), lr=cfg["lr"], weight_decay=1e-5)

    train_ds = InstallShards(cfg["train"], cfg["large_tables"], cfg["small_tables"])
    val_ds = InstallShards(cfg["val"], cfg["large_tables"], cfg["small_tables"])
    sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    loader = DataLoader(train_ds, batch_size=cfg["batch_size"], sampler=sampler, drop_last=True,
                        num_workers=6, pin_memory=True)
    val_loader = DataLoader(val_ds, batch_size=cfg["batch_size"], drop_last=True, num_workers=6,
                            sampler=DistributedSampler(val_ds, shuffle=False, drop_last=True))

    for epoch in range(start_epoch, cfg["epochs"]):
        sampler.set_epoch(epoch)
        large.train(), dense.train()
        tic = time.time()
        for it, (lid, sid, dfe, y) in enumerate(loader):
            lid, sid, dfe, y = (t.to(device, non_blocking=True) for t in (lid, sid, dfe, y))
            loss = F.binary_cross_entropy_with_logits(dense(large(lid), sid, dfe), y)
            sparse_opt.zero_grad()
            dense_opt.zero_grad()
            loss.backward()
            sparse_opt.step()
            dense_opt.step()
            if rank == 0 and it % 200 == 0:
                print(f"ep {epoch} it {it}/{len(loader)} loss {loss.item():.4f} "
                      f"{(it + 1) * cfg['batch_size'] * world / (time.time() - tic):.0f} ex/s", flush=True)

        large.eval(), dense.eval()
        stat = torch.zeros(2, device=device)
        with torch.no_grad():
            for lid, sid, dfe, y in val_loader:
                lid, sid, dfe, y = (t.to(device, non_blocking=True) for t in (lid, sid, dfe, y))
                stat[0] += F.binary_cross_entropy_with_logits(dense(large(lid), sid, dfe), y, reduction="sum")
                stat[1] += y.numel()
        dist.all_reduce(stat)
        if rank == 0:
            print(f"epoch {epoch} val logloss {(stat[0] / stat[1]).item():.5f}", flush=True)

        torch.save(large.state_dict(), shard_path)
        if rank == 0:
            torch.save({"dense": dense.state_dict(), "epoch": epoch, "world_size": world}, cfg["ckpt"])
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
