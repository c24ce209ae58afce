# DLRM on Criteo (terabyte, hashed to 10M rows/table) with hand-rolled table-wise
# model parallelism for the 26 sparse features and data parallel dense part.
#
# each rank owns a subset of the tables; ids are all-gathered, looked up locally
# for the global batch, then all_to_all'd back so every rank gets the embeddings
# of its own samples for every table.
import argparse
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
from sklearn.metrics import roc_auc_score
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

NUM_DENSE = 13
NUM_SPARSE = 26


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data-dir", default="/mnt/criteo/npy")
    p.add_argument("--table-cap", type=int, default=10_000_000)
    p.add_argument("--emb-dim", type=int, default=128)
    p.add_argument("--bottom-mlp", default="512,256,128")
    p.add_argument("--top-mlp", default="1024,1024,512,256,1")
    p.add_argument("--batch-size", type=int, default=2048, help="per rank")
    p.add_argument("--dense-lr", type=float, default=1e-3)
    p.add_argument("--emb-lr", type=float, default=0.05)
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--eval-every", type=int, default=20000)
    p.add_argument("--ckpt-dir", default="ckpt/dlrm")
    return p.parse_args()


class CriteoNpy(Dataset):
    def __init__(self, root, split):
        self.dense = np.load(os.path.join(root, f"{split}_dense.npy"), mmap_mode="r")
        self.sparse = np.load(os.path.join(root, f"{split}_sparse.npy"), mmap_mode="r")
        self.label = np.load(os.path.join(root, f"{split}_label.npy"), mmap_mode="r")

    def __len__(self):
        return self.label.shape[0]

    def __getitem__(self, i):
        dense = np.log1p(np.maximum(self.dense[i], 0)).astype(np.float32)
        return torch.from_numpy(dense), torch.from_numpy(self.sparse[i].astype(np.int64)), float(self.label[i])


def table_owner(n_tables, world):
    return {r: [t for t in range(n_tables) if t % world == r] for r in range(world)}


class _EmbAllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, local_out, batch_per_rank, splits):
        # local_out: [world * B, n_local, D] -> returns [B, sum(splits), D]
        world = len(splits)
        dim = local_out.shape[-1]
        ctx.batch_per_rank, ctx.splits, ctx.n_local = batch_per_rank, splits, local_out.shape[1]
        send = [s.contiguous() for s in local_out.split(batch_per_rank, dim=0)]
        recv = [local_out.new_empty(batch_per_rank, splits[src], dim) for src in range(world)]
        dist.all_to_all(recv, send)
        return torch.cat(recv, dim=1)

    @staticmethod
    def backward(ctx, grad):
        world = len(ctx.splits)
        send = [g.contiguous() for g in grad.split(ctx.splits, dim=1)]
        recv = [grad.new_empty(ctx.batch_per_rank, ctx.n_local, grad.shape[-1]) for _ in range(world)]
        dist.all_to_all(recv, send)
        # dense grads are averaged by DDP, keep the embeddings on the same scale
        return torch.cat(recv, dim=0) / world, None, None


class ShardedEmbeddings(nn.Module):
    def __init__(self, table_sizes, dim, rank, world):
        super().__init__()
        self.rank, self.world = rank, world
        owner = table_owner(len(table_sizes), world)
        self.local_tables = owner[rank]
        self.tables_per_rank = [len(owner[r]) for r in range(world)]
        self.embs = nn.ModuleList(
            [nn.Embedding(table_sizes[t], dim, sparse=True) for t in self.local_tables]
        )
        for e in self.embs:
            nn.init.uniform_(e.weight, -1.0 / np.sqrt(e.num_embeddings), 1.0 / np.sqrt(e.num_embeddings))
        order = [t for r in range(world) for t in owner[r]]
        self.register_buffer("inv_perm", torch.tensor(np.argsort(order)), persistent=False)

    def forward(self, sparse_local):
        B = sparse_local.shape[0]
        gathered = [torch.empty_like(sparse_local) for _ in range(self.world)]
        dist.all_gather(gathered, sparse_local)
        all_ids = torch.cat(gathered, dim=0)
        local_out = torch.stack([emb(all_ids[:, t]) for emb, t in zip(self.embs, self.local_tables)], dim=1)
        out = _EmbAllToAll.apply(local_out, B, [len(self.local_tables)] * self.world)
        return out[:, self.inv_perm]


def mlp(sizes, sigmoid_last=False):
    layers = []
    for i in range(len(sizes) - 1):
        layers.append(nn.Linear(sizes[i], sizes[i + 1]))
        if i < len(sizes) - 2:
            layers.append(nn.ReLU(inplace=True))
    return nn.Sequential(*layers)


class DenseArch(nn.Module):
    def __init__(self, bottom, top, dim):
        super().__init__()
        self.bottom = mlp([NUM_DENSE] + bottom)
        n = NUM_SPARSE + 1
        n_inter = n * (n - 1) // 2
        self.top = mlp([dim + n_inter] + top)
        li, lj = torch.tril_indices(n, n, offset=-1)
        self.register_buffer("li", li, persistent=False)
        self.register_buffer("lj", lj, persistent=False)

    def forward(self, dense_x, emb):
        x = self.bottom(dense_x)
        T = torch.cat([x.unsqueeze(1), emb], dim=1)
        Z = torch.bmm(T, T.transpose(1, 2))
        inter = Z[:, self.li, self.lj]
        return self.top(torch.cat([x, inter], dim=1)).squeeze(1)


@torch.no_grad()
def evaluate(dense, embs, loader, device, rank, world):
    dense.eval()
    preds, labels = [], []
    for xd, xs, y in loader:
        xd, xs = xd.to(device, non_blocking=True), xs.to(device, non_blocking=True)
        logits = dense(xd, embs(xs))
        preds.append(torch.sigmoid(logits))
        labels.append(y.to(device).float())
    preds, labels = torch.cat(preds), torch.cat(labels)
    all_p = [torch.empty_like(preds) for _ in range(world)]
    all_y = [torch.empty_like(labels) for _ in range(world)]
    dist.all_gather(all_p, preds)
    dist.all_gather(all_y, labels)
    dense.train()
    if rank == 0:
        return roc_auc_score(torch.cat(all_y).cpu().numpy(), torch.cat(all_p).cpu().numpy())
    return None


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(1234)

    counts = np.load(os.path.join(args.data_dir, "day_fea_count.npy"))
    table_sizes = [int(min(c, args.table_cap)) for c in counts]

    train_ds = CriteoNpy(args.data_dir, "train")
    val_ds = CriteoNpy(args.data_dir, "val")
    train_sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    val_sampler = DistributedSampler(val_ds, shuffle=False, drop_last=True)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=train_sampler, num_workers=6,
                              pin_memory=True, drop_last=True)
    val_loader = DataLoader(val_ds, batch_size=args.batch_size, sampler=val_sampler, num_workers=6,
                            pin_memory=True, drop_last=True)

    embs = ShardedEmbeddings(table_sizes, args.emb_dim, rank, world).to(device)
    bottom = [int(s) for s in args.bottom_mlp.split(",")]
    top = [int(s) for s in args.top_mlp.split(",")]
    dense = DDP(DenseArch(bottom, top, args.emb_dim).to(device), device_ids=[local_rank])

    dense_opt = torch.optim.Adam(dense.parameters(), lr=args.dense_lr)
    emb_opt = torch.optim.SGD(embs.parameters(), lr=args.emb_lr)
    loss_fn = nn.BCEWithLogitsLoss()

    if rank == 0:
        print(f"world {world}, tables per rank {embs.tables_per_rank}, "
              f"local rows {sum(e.num_embeddings for e in embs.embs) / 1e6:.1f}M", flush=True)

    step = 0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        t0 = time.time()
        for xd, xs, y in train_loader:
            xd = xd.to(device, non_blocking=True)
            xs = xs.to(device, non_blocking=True)
            y = y.to(device, non_blocking=True).float()

            logits = dense(xd, embs(xs))
            loss = loss_fn(logits, y)
            dense_opt.zero_grad(set_to_none=True)
            emb_opt.zero_grad(set_to_none=True)
            loss.backward()
            dense_opt.step()
            emb_opt.step()
            step += 1

            if step % 500 == 0 and rank == 0:
                print(f"epoch {epoch} step {step} loss {loss.item():.5f} "
                      f"{500 * args.batch_size * world / (time.time() - t0):.0f} samples/s", flush=True)
                t0 = time.time()

            if step % args.eval_every == 0:
                auc = evaluate(dense, embs, val_loader, device, rank, world)
                if rank == 0:
                    print(f"step {step} val AUC {auc:.5f}", flush=True)

    os.makedirs(args.ckpt_dir, exist_ok=True)
    torch.save({"tables": embs.local_tables, "state": embs.state_dict()},
               os.path.join(args.ckpt_dir, f"emb_shard_{rank}_of_{world}.pt"))
    if rank == 0:
        torch.save(dense.module.state_dict(), os.path.join(args.ckpt_dir, "dense.pt"))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
