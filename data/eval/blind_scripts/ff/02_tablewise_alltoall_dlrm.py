"""Hand-written table-wise model parallel DLRM.

Every embedding table lives on exactly one rank. Sparse ids of the local
minibatch are all-gathered, each rank pools its own tables for the global
batch and an all-to-all returns to every rank the pooled embeddings of its
own samples for all tables. The bottom/top MLPs are replicated with DDP.

    torchrun --nproc_per_node=8 02_tablewise_alltoall_dlrm.py --data_dir /data/criteo_npy
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
from sklearn.metrics import roc_auc_score
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter


class CriteoNpy(Dataset):
    def __init__(self, root, split):
        self.dense = np.load(os.path.join(root, f"{split}_dense.npy"), mmap_mode="r")
        self.sparse = np.load(os.path.join(root, f"{split}_sparse.npy"), mmap_mode="r")
        self.labels = np.load(os.path.join(root, f"{split}_labels.npy"), mmap_mode="r")

    def __len__(self):
        return self.labels.shape[0]

    def __getitem__(self, i):
        dense = np.log1p(np.maximum(self.dense[i], 0)).astype(np.float32)
        return (
            torch.from_numpy(dense),
            torch.from_numpy(np.asarray(self.sparse[i], dtype=np.int64)),
            torch.tensor(self.labels[i], dtype=torch.float32),
        )


def place_tables(table_sizes, world_size):
    """Greedy size-balanced table-wise placement, identical on every rank."""
    order = sorted(range(len(table_sizes)), key=lambda t: (-table_sizes[t], t))
    load = [0] * world_size
    owner = [0] * len(table_sizes)
    for t in order:
        r = min(range(world_size), key=lambda k: (load[k], k))
        owner[t] = r
        load[r] += table_sizes[t]
    return [sorted(t for t in range(len(table_sizes)) if owner[t] == r) for r in range(world_size)]


class PooledAllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, local_pooled, in_splits, out_splits, world_size):
        ctx.shape = local_pooled.shape
        ctx.in_splits, ctx.out_splits = in_splits, out_splits
        ctx.world_size = world_size
        send = local_pooled.contiguous().view(-1)
        recv = send.new_empty(sum(out_splits))
        dist.all_to_all_single(recv, send, out_splits, in_splits)
        return recv

    @staticmethod
    def backward(ctx, grad_out):
        grad_out = grad_out.contiguous()
        grad_in = grad_out.new_empty(sum(ctx.in_splits))
        dist.all_to_all_single(grad_in, grad_out, ctx.in_splits, ctx.out_splits)
        # the local loss is a mean over the local batch; DDP averages the dense
        # grads over ranks, so scale the table grads the same way
        grad_in = grad_in.div_(ctx.world_size)
        return grad_in.view(ctx.shape), None, None, None


class ShardedEmbeddings(nn.Module):
    def __init__(self, table_sizes, dim, rank, world_size, device):
        super().__init__()
        self.dim = dim
        self.rank = rank
        self.world_size = world_size
        self.tables_per_rank = place_tables(table_sizes, world_size)
        self.local_tables = self.tables_per_rank[rank]
        self.emb = nn.ModuleList(
            [nn.Embedding(table_sizes[t], dim, sparse=True, device=device) for t in self.local_tables]
        )
        for e in self.emb:
            nn.init.uniform_(e.weight, -1.0 / np.sqrt(e.num_embeddings), 1.0 / np.sqrt(e.num_embeddings))
        owner_order = [t for ts in self.tables_per_rank for t in ts]
        inv = torch.empty(len(owner_order), dtype=torch.long)
        inv[torch.tensor(owner_order)] = torch.arange(len(owner_order))
        self.register_buffer("inv_perm", inv.to(device), persistent=False)

    def forward(self, sparse):
        b = sparse.size(0)
        gathered = sparse.new_empty(b * self.world_size, sparse.size(1))
        dist.all_gather_into_tensor(gathered, sparse.contiguous())
        pooled = torch.stack([e(gathered[:, t]) for e, t in zip(self.emb, self.local_tables)], dim=1)
        pooled = pooled.view(b * self.world_size, -1)
        in_splits = [b * len(self.local_tables) * self.dim] * self.world_size
        out_splits = [b * len(ts) * self.dim for ts in self.tables_per_rank]
        recv = PooledAllToAll.apply(pooled, in_splits, out_splits, self.world_size)
        chunks = [c.view(b, len(ts), self.dim) for c, ts in zip(recv.split(out_splits), self.tables_per_rank)]
        return torch.cat(chunks, dim=1)[:, self.inv_perm]


def mlp(sizes):
    layers = []
    for i in range(len(sizes) - 1):
        layers += [nn.Linear(sizes[i], sizes[i + 1]), nn.ReLU()]
    return nn.Sequential(*layers[:-1])


class DenseArch(nn.Module):
    def __init__(self, num_dense, num_sparse, dim, bottom, top):
        super().__init__()
        self.bottom = nn.Sequential(mlp([num_dense] + bottom), nn.ReLU())
        n = num_sparse + 1
        self.register_buffer("triu", torch.triu_indices(n, n, offset=1), persistent=False)
        self.top = mlp([dim + n * (n - 1) // 2] + top)

    def forward(self, dense, emb):
        x = self.bottom(dense)
        feats = torch.cat([x.unsqueeze(1), emb], dim=1)
        inter = torch.bmm(feats, feats.transpose(1, 2))[:, self.triu[0], self.triu[1]]
        return self.top(torch.cat([x, inter], dim=1)).squeeze(1)


def evaluate(emb, dense, loader, device, world_size):
    emb.eval()
    dense.eval()
    preds, labels = [], []
    loss_sum = torch.zeros(2, device=device)
    with torch.no_grad():
        for d, s, y in loader:
            d, s, y = d.to(device), s.to(device), y.to(device)
            logits = dense(d, emb(s))
            loss_sum[0] += F.binary_cross_entropy_with_logits(logits, y, reduction="sum")
            loss_sum[1] += y.numel()
            preds.append(torch.sigmoid(logits))
            labels.append(y)
    dist.all_reduce(loss_sum)
    preds, labels = torch.cat(preds), torch.cat(labels)
    all_p = preds.new_empty(preds.numel() * world_size)
    all_y = labels.new_empty(labels.numel() * world_size)
    dist.all_gather_into_tensor(all_p, preds)
    dist.all_gather_into_tensor(all_y, labels)
    emb.train()
    dense.train()
    auc = roc_auc_score(all_y.cpu().numpy(), all_p.cpu().numpy())
    return (loss_sum[0] / loss_sum[1]).item(), auc


def save_checkpoint(args, emb, dense, emb_opt, dense_opt, epoch, rank, world_size):
    path = os.path.join(args.ckpt_dir, f"epoch_{epoch}")
    os.makedirs(path, exist_ok=True)
    torch.save(
        {"tables": emb.local_tables, "state": emb.state_dict(), "opt": emb_opt.state_dict()},
        os.path.join(path, f"emb_rank{rank}_of_{world_size}.pt"),
    )
    if rank == 0:
        torch.save(
            {"dense": dense.module.state_dict(), "opt": dense_opt.state_dict(),
             "epoch": epoch, "world_size": world_size},
            os.path.join(path, "dense.pt"),
        )
    dist.barrier()
    if rank == 0:
        with open(os.path.join(args.ckpt_dir, "latest.txt"), "w") as f:
            f.write(path)


def try_resume(args, emb, dense, emb_opt, dense_opt, rank, world_size, device):
    marker = os.path.join(args.ckpt_dir, "latest.txt")
    if not os.path.exists(marker):
        return 0
    path = open(marker).read().strip()
    meta = torch.load(os.path.join(path, "dense.pt"), map_location=device)
    if meta["world_size"] != world_size:
        raise RuntimeError(
            f"checkpoint has {meta['world_size']} table shards, this job has {world_size} ranks; "
            "reshard it with tools/reshard_tables.py first"
        )
    dense.module.load_state_dict(meta["dense"])
    dense_opt.load_state_dict(meta["opt"])
    shard = torch.load(os.path.join(path, f"emb_rank{rank}_of_{world_size}.pt"), map_location=device)
    assert shard["tables"] == emb.local_tables
    emb.load_state_dict(shard["state"])
    emb_opt.load_state_dict(shard["opt"])
    return meta["epoch"] + 1


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--data_dir", required=True)
    p.add_argument("--ckpt_dir", default="/shared/ckpt/tw_dlrm")
    p.add_argument("--log_dir", default="runs/tw_dlrm")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--batch_size", type=int, default=4096, help="per rank")
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--sparse_lr", type=float, default=1e-2)
    p.add_argument("--workers", type=int, default=6)
    args = p.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    dist.init_process_group("nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(1234 + rank)  # tables differ per rank anyway

    with open(os.path.join(args.data_dir, "table_sizes.json")) as f:
        table_sizes = json.load(f)
    assert world_size <= len(table_sizes)

    train_set = CriteoNpy(args.data_dir, "train")
    val_set = CriteoNpy(args.data_dir, "val")
    train_sampler = DistributedSampler(train_set, shuffle=True, seed=17, drop_last=True)
    val_sampler = DistributedSampler(val_set, shuffle=False)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=args.workers, pin_memory=True, drop_last=True,
                              persistent_workers=True)
    val_loader = DataLoader(val_set, batch_size=args.batch_size, sampler=val_sampler,
                            num_workers=args.workers, pin_memory=True)

    emb = ShardedEmbeddings(table_sizes, args.dim, rank, world_size, device)
    torch.manual_seed(1234)
    dense = DDP(DenseArch(13, len(table_sizes), args.dim, [512, 256, args.dim], [1024, 512, 256, 1]).to(device),
                device_ids=[local_rank])
    emb_opt = torch.optim.SparseAdam(emb.parameters(), lr=args.sparse_lr)
    dense_opt = torch.optim.Adam(dense.parameters(), lr=args.lr)

    start_epoch = try_resume(args, emb, dense, emb_opt, dense_opt, rank, world_size, device)
    writer = SummaryWriter(args.log_dir) if rank == 0 else None
    if rank == 0:
        print(f"tables per rank: {emb.tables_per_rank}", flush=True)

    step = start_epoch * len(train_loader)
    for epoch in range(start_epoch, args.epochs):
        train_sampler.set_epoch(epoch)
        t0 = time.time()
        for d, s, y in train_loader:
            d = d.to(device, non_blocking=True)
            s = s.to(device, non_blocking=True)
            y = y.to(device, non_blocking=True)
            logits = dense(d, emb(s))
            loss = F.binary_cross_entropy_with_logits(logits, y)
            emb_opt.zero_grad(set_to_none=True)
            dense_opt.zero_grad(set_to_none=True)
            loss.backward()
            emb_opt.step()
            dense_opt.step()
            step += 1
            if step % 200 == 0 and rank == 0:
                ex_s = 200 * args.batch_size * world_size / (time.time() - t0)
                writer.add_scalar("train/loss", loss.item(), step)
                writer.add_scalar("train/examples_per_s", ex_s, step)
                t0 = time.time()

        val_loss, val_auc = evaluate(emb, dense, val_loader, device, world_size)
        if rank == 0:
            writer.add_scalar("val/loss", val_loss, step)
            writer.add_scalar("val/auc", val_auc, step)
            print(f"epoch {epoch} val_loss {val_loss:.5f} auc {val_auc:.5f}", flush=True)
        save_checkpoint(args, emb, dense, emb_opt, dense_opt, epoch, rank, world_size)

    if writer is not None:
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
