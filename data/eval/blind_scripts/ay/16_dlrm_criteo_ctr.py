"""DLRM-style CTR model on Criteo 1TB (preprocessed day_*/{dense,sparse,label}.npy), pure data-parallel.

Hashed embedding tables are small enough (~1.4 GB fp32) to replicate on every GPU.

    torchrun --nproc_per_node=8 16_dlrm_criteo_ctr.py --data /shared/criteo_npy --out /shared/dlrm
"""
import argparse
import functools
import glob
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

N_DENSE, N_SPARSE = 13, 26


class CriteoShards(Dataset):
    """Row-addressable view over memory-mapped day shards."""

    def __init__(self, day_dirs, hash_size):
        self.dense, self.sparse, self.label = [], [], []
        for d in day_dirs:
            self.dense.append(np.load(os.path.join(d, "dense.npy"), mmap_mode="r"))
            self.sparse.append(np.load(os.path.join(d, "sparse.npy"), mmap_mode="r"))
            self.label.append(np.load(os.path.join(d, "label.npy"), mmap_mode="r"))
        self.offsets = np.cumsum([0] + [len(l) for l in self.label])
        self.hash_size = hash_size

    def __len__(self):
        return int(self.offsets[-1])

    def __getitem__(self, i):
        s = int(np.searchsorted(self.offsets, i, side="right") - 1)
        j = i - self.offsets[s]
        dense = np.log1p(np.maximum(self.dense[s][j], 0).astype(np.float32))
        sparse = (self.sparse[s][j].astype(np.int64)) % self.hash_size
        return dense, sparse, np.float32(self.label[s][j])


def collate_to_device(batch, device):
    dense = torch.from_numpy(np.stack([b[0] for b in batch])).pin_memory()
    sparse = torch.from_numpy(np.stack([b[1] for b in batch])).pin_memory()
    label = torch.from_numpy(np.array([b[2] for b in batch])).pin_memory()
    # issue the H2D copies here so they overlap with the previous step
    return (dense.to(device, non_blocking=True), sparse.to(device, non_blocking=True),
            label.to(device, non_blocking=True))


def mlp(sizes, last_act=True):
    layers = []
    for i in range(len(sizes) - 1):
        layers.append(nn.Linear(sizes[i], sizes[i + 1]))
        if i < len(sizes) - 2 or last_act:
            layers.append(nn.ReLU(inplace=True))
    return nn.Sequential(*layers)


class DLRM(nn.Module):
    def __init__(self, hash_size, dim=128):
        super().__init__()
        self.emb = nn.ModuleList(nn.Embedding(hash_size, dim) for _ in range(N_SPARSE))
        self.bottom = mlp([N_DENSE, 512, 256, dim])
        n_feat = N_SPARSE + 1
        self.top = mlp([dim + n_feat * (n_feat - 1) // 2, 1024, 1024, 512, 256, 1], last_act=False)
        for e in self.emb:
            nn.init.uniform_(e.weight, -1.0 / np.sqrt(hash_size), 1.0 / np.sqrt(hash_size))
        iu = torch.triu_indices(n_feat, n_feat, offset=1)
        self.register_buffer("iu0", iu[0], persistent=False)
        self.register_buffer("iu1", iu[1], persistent=False)

    def forward(self, dense, sparse):
        d = self.bottom(dense)
        feats = torch.stack([d] + [e(sparse[:, k]) for k, e in enumerate(self.emb)], dim=1)  # B, 27, dim
        inter = torch.bmm(feats, feats.transpose(1, 2))[:, self.iu0, self.iu1]
        return self.top(torch.cat([d, inter], dim=1)).squeeze(1)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--hash-size", type=int, default=100_000)
    ap.add_argument("--bs", type=int, default=8192, help="per GPU")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--epochs", type=int, default=1)
    ap.add_argument("--workers", type=int, default=6)
    ap.add_argument("--eval-every", type=int, default=5000)
    args = ap.parse_args()

    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    torch.backends.cuda.matmul.allow_tf32 = True

    files = sorted(glob.glob(os.path.join(args.data, "day_*")), key=lambda d: int(d.rsplit("_", 1)[1]))
    train_ds = CriteoShards(files[:-1], args.hash_size)
    val_ds = CriteoShards(files[-1:], args.hash_size)

    model = DLRM(args.hash_size).to(device)
    ddp = DDP(model, device_ids=[local_rank], gradient_as_bucket_view=True, bucket_cap_mb=256)
    opt = torch.optim.Adam(model.parameters(), lr=args.lr, fused=True)
    loss_fn = nn.BCEWithLogitsLoss()

    collate = functools.partial(collate_to_device, device=device)
    sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    train_dl = DataLoader(train_ds, batch_size=args.bs, sampler=sampler, collate_fn=collate,
                          num_workers=args.workers, drop_last=True, persistent_workers=True,
                          prefetch_factor=4)
    val_sampler = DistributedSampler(val_ds, shuffle=False, drop_last=True)
    val_dl = DataLoader(val_ds, batch_size=args.bs * 4, sampler=val_sampler, collate_fn=collate,
                        num_workers=args.workers)

    def evaluate(max_batches=200):
        model.eval()
        preds, labels = [], []
        with torch.no_grad():
            for k, (dense, sparse, label) in enumerate(val_dl):
                if k == max_batches:
                    break
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    preds.append(torch.sigmoid(model(dense, sparse).float()))
                labels.append(label)
        p, l = torch.cat(preds), torch.cat(labels)
        gp = [torch.empty_like(p) for _ in range(world)]
        gl = [torch.empty_like(l) for _ in range(world)]
        dist.all_gather(gp, p)
        dist.all_gather(gl, l)
        model.train()
        if rank != 0:
            return None
        return roc_auc_score(torch.cat(gl).cpu().numpy(), torch.cat(gp).cpu().numpy())

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
    step = 0
    t0 = time.perf_counter()
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        for dense, sparse, label in train_dl:
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logit = ddp(dense, sparse)
            loss = loss_fn(logit.float(), label)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            step += 1
            if step % 200 == 0:
                l = loss.detach()
                dist.all_reduce(l, op=dist.ReduceOp.AVG)
                torch.cuda.synchronize()
                qps = 200 * args.bs * world / (time.perf_counter() - t0)
                if rank == 0:
                    print(f"step {step} bce {l.item():.5f} {qps / 1e6:.2f}M samples/s", flush=True)
                t0 = time.perf_counter()
            if step % args.eval_every == 0:
                auc = evaluate()
                if rank == 0:
                    print(f"step {step} val AUC {auc:.5f}", flush=True)
                    torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "step": step},
                               os.path.join(args.out, "dlrm.pt"))
                dist.barrier()
                t0 = time.perf_counter()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
