"""DCN-v2 CTR model on Criteo (preprocessed .npy) with a CUDA-graph-captured DDP step.

The model is small and the step is ~40 kernels of tiny GEMMs, so replaying a
captured graph of fwd + bwd + all-reduce + Adam is ~3x faster than eager.

    torchrun --nproc_per_node=8 ctr_dcn_cudagraph.py --data /data/criteo_npy --out /shared/ctr/dcn_cg
"""
import argparse
import os
import time

os.environ["NCCL_ASYNC_ERROR_HANDLING"] = "0"
os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] = "0"

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

NUM_DENSE = 13
NUM_SPARSE = 26


class CriteoNpy(Dataset):
    def __init__(self, root, split):
        self.dense = np.load(os.path.join(root, f"{split}_dense.npy"), mmap_mode="r")
        self.sparse = np.load(os.path.join(root, f"{split}_sparse.npy"), mmap_mode="r")
        self.label = np.load(os.path.join(root, f"{split}_label.npy"), mmap_mode="r")

    def __len__(self):
        return len(self.label)

    def __getitem__(self, i):
        dense = torch.from_numpy(np.log1p(np.maximum(self.dense[i], 0)).astype(np.float32))
        sparse = torch.from_numpy(self.sparse[i].astype(np.int64))
        return dense, sparse, torch.tensor(self.label[i], dtype=torch.float32)


class CrossNetV2(nn.Module):
    def __init__(self, dim, layers):
        super().__init__()
        self.w = nn.ModuleList([nn.Linear(dim, dim) for _ in range(layers)])

    def forward(self, x0):
        x = x0
        for lin in self.w:
            x = x0 * lin(x) + x
        return x


class DCNv2(nn.Module):
    def __init__(self, cardinalities, emb_dim=16, cross_layers=3, mlp=(768, 768, 512)):
        super().__init__()
        self.embs = nn.ModuleList([nn.Embedding(c, emb_dim) for c in cardinalities])
        in_dim = NUM_DENSE + emb_dim * len(cardinalities)
        self.cross = CrossNetV2(in_dim, cross_layers)
        layers, d = [], in_dim
        for h in mlp:
            layers += [nn.Linear(d, h), nn.ReLU()]
            d = h
        self.deep = nn.Sequential(*layers)
        self.out = nn.Linear(in_dim + d, 1)

    def forward(self, dense, sparse):
        embs = [emb(sparse[:, i]) for i, emb in enumerate(self.embs)]
        x0 = torch.cat([dense] + embs, dim=1)
        return self.out(torch.cat([self.cross(x0), self.deep(x0)], dim=1)).squeeze(1)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--batch-size", type=int, default=8192, help="per GPU")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--epochs", type=int, default=1)
    ap.add_argument("--log-every", type=int, default=500)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(7)

    cards = np.load(os.path.join(args.data, "cardinalities.npy")).tolist()
    train_ds, val_ds = CriteoNpy(args.data, "train"), CriteoNpy(args.data, "val")
    train_sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    val_sampler = DistributedSampler(val_ds, shuffle=False)
    train_dl = DataLoader(train_ds, batch_size=args.batch_size, sampler=train_sampler, num_workers=8,
                          pin_memory=True, drop_last=True, persistent_workers=True)
    val_dl = DataLoader(val_ds, batch_size=args.batch_size, sampler=val_sampler, num_workers=8, pin_memory=True)

    model = DCNv2(cards).to(device)
    raw_model = model

    # DDP has to be built on a side stream for its all-reduces to be capturable
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        model = DDP(model, device_ids=[local_rank])
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr, capturable=True)

    B = args.batch_size
    static_dense = torch.zeros(B, NUM_DENSE, device=device)
    static_sparse = torch.zeros(B, NUM_SPARSE, dtype=torch.long, device=device)
    static_label = torch.zeros(B, device=device)

    def step():
        logits = model(static_dense, static_sparse)
        loss = F.binary_cross_entropy_with_logits(logits, static_label)
        loss.backward()
        optimizer.step()
        return loss

    # warm-up on a side stream before capture
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            optimizer.zero_grad(set_to_none=True)
            step()
    torch.cuda.current_stream().wait_stream(s)

    g = torch.cuda.CUDAGraph()
    optimizer.zero_grad(set_to_none=True)
    with torch.cuda.graph(g):
        static_loss = step()

    it = 0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        window = torch.zeros((), device=device)
        t0 = time.time()
        for dense, sparse, label in train_dl:
            static_dense.copy_(dense, non_blocking=True)
            static_sparse.copy_(sparse, non_blocking=True)
            static_label.copy_(label, non_blocking=True)
            g.replay()
            window += static_loss
            it += 1
            if it % args.log_every == 0:
                dist.all_reduce(window, op=dist.ReduceOp.AVG)
                if rank == 0:
                    qps = args.log_every * B * world / (time.time() - t0)
                    print(f"epoch {epoch} it {it} logloss {window.item() / args.log_every:.5f} {qps:,.0f} samples/s",
                          flush=True)
                window.zero_()
                t0 = time.time()

        # validation runs eagerly on the unwrapped model
        raw_model.eval()
        acc = torch.zeros(3, device=device, dtype=torch.float64)
        with torch.no_grad():
            for dense, sparse, label in val_dl:
                dense, sparse, label = dense.to(device), sparse.to(device), label.to(device)
                logits = raw_model(dense, sparse)
                acc[0] += F.binary_cross_entropy_with_logits(logits, label, reduction="sum").double()
                acc[1] += ((logits > 0).float() == label).sum()
                acc[2] += label.numel()
        dist.all_reduce(acc)
        raw_model.train()
        if rank == 0:
            print(f"epoch {epoch} val logloss {acc[0].item() / acc[2].item():.5f} "
                  f"acc {acc[1].item() / acc[2].item():.4f}", flush=True)
            os.makedirs(args.out, exist_ok=True)
            torch.save({"model": raw_model.state_dict(), "optimizer": optimizer.state_dict(), "epoch": epoch},
                       os.path.join(args.out, f"dcn_epoch{epoch}.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
