"""NFM (bi-interaction pooling + MLP) for the marketplace CTR model, with a
TorchScript export of the best checkpoint for the serving team.

    torchrun --standalone --nproc_per_node=8 20_nfm_export.py --workdir /mnt/shared/market_ctr/nfm_v7
"""
import argparse
import json
import logging
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


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", default="/mnt/shared/market_ctr/hashed")
    ap.add_argument("--workdir", default="/mnt/shared/market_ctr/nfm")
    ap.add_argument("--num-fields", type=int, default=22)
    ap.add_argument("--hash-size", type=int, default=1 << 24)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--hidden", default="256,128")
    ap.add_argument("--bi-dropout", type=float, default=0.3)
    ap.add_argument("--batch-size", type=int, default=4096)
    ap.add_argument("--lr", type=float, default=5e-4)
    ap.add_argument("--epochs", type=int, default=4)
    return ap.parse_args()


class HashedCTR(Dataset):
    def __init__(self, root, split):
        self.x = np.load(os.path.join(root, f"{split}_x.npy"), mmap_mode="r")
        self.y = np.load(os.path.join(root, f"{split}_y.npy"), mmap_mode="r")

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        return torch.from_numpy(self.x[i].astype(np.int64)), torch.tensor(self.y[i], dtype=torch.float32)


class NFM(nn.Module):
    def __init__(self, hash_size: int, dim: int, hidden, bi_dropout: float):
        super().__init__()
        self.emb = nn.Embedding(hash_size, dim)
        self.lin = nn.Embedding(hash_size, 1)
        self.bias = nn.Parameter(torch.zeros(1))
        nn.init.normal_(self.emb.weight, std=0.01)
        nn.init.zeros_(self.lin.weight)
        self.bi_bn = nn.BatchNorm1d(dim)
        self.bi_drop = nn.Dropout(bi_dropout)
        layers, d = [], dim
        for h in hidden:
            layers += [nn.Linear(d, h), nn.BatchNorm1d(h), nn.ReLU(), nn.Dropout(0.2)]
            d = h
        layers.append(nn.Linear(d, 1))
        self.mlp = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        e = self.emb(x)
        bi = 0.5 * (e.sum(1).pow(2) - e.pow(2).sum(1))
        bi = self.bi_drop(self.bi_bn(bi))
        return self.bias + self.lin(x).sum((1, 2)) + self.mlp(bi).squeeze(1)


@torch.no_grad()
def evaluate(model, loader, device, n):
    model.eval()
    ps, ys = [], []
    for x, y in loader:
        ps.append(torch.sigmoid(model(x.to(device, non_blocking=True))))
        ys.append(y.to(device, non_blocking=True))
    p, y = torch.cat(ps), torch.cat(ys)
    ws = dist.get_world_size()
    gp, gy = [torch.empty_like(p) for _ in range(ws)], [torch.empty_like(y) for _ in range(ws)]
    dist.all_gather(gp, p)
    dist.all_gather(gy, y)
    model.train()
    p = torch.stack(gp, 1).flatten()[:n].cpu().numpy()
    y = torch.stack(gy, 1).flatten()[:n].cpu().numpy()
    return roc_auc_score(y, p)


def export_torchscript(args, ckpt_path, out_path):
    hidden = [int(h) for h in args.hidden.split(",")]
    model = NFM(args.hash_size, args.dim, hidden, args.bi_dropout)
    state = torch.load(ckpt_path, map_location="cpu")
    model.load_state_dict(state["model"])
    model.eval()
    scripted = torch.jit.script(model)
    scripted.save(out_path)
    with open(out_path + ".json", "w") as f:
        json.dump({"num_fields": args.num_fields, "hash_size": args.hash_size, "auc": state["auc"],
                   "epoch": state["epoch"]}, f, indent=2)


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format="%(asctime)s %(message)s")
    log = logging.getLogger("nfm")

    train, valid = HashedCTR(args.data, "train"), HashedCTR(args.data, "valid")
    sampler = DistributedSampler(train, shuffle=True)
    train_dl = DataLoader(train, batch_size=args.batch_size, sampler=sampler, num_workers=8,
                          pin_memory=True, drop_last=True, persistent_workers=True)
    valid_dl = DataLoader(valid, batch_size=16384, sampler=DistributedSampler(valid, shuffle=False),
                          num_workers=4, pin_memory=True)

    model = NFM(args.hash_size, args.dim, [int(h) for h in args.hidden.split(",")], args.bi_dropout)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).to(device)
    model = DDP(model, device_ids=[local_rank])
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)

    ckpt_dir = os.path.join(args.workdir, "checkpoints")
    if rank == 0:
        os.makedirs(ckpt_dir, exist_ok=True)
    best_auc, best_path = -1.0, os.path.join(ckpt_dir, "best.pt")

    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        t0 = time.time()
        for it, (x, y) in enumerate(train_dl):
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            loss = F.binary_cross_entropy_with_logits(model(x), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            if it % 500 == 0:
                log.info("epoch %d it %d/%d loss %.5f %.0fs", epoch, it, len(train_dl), loss.item(),
                         time.time() - t0)

        auc = evaluate(model, valid_dl, device, len(valid))
        log.info("epoch %d valid auc %.5f", epoch, auc)
        if rank == 0:
            state = {"model": model.state_dict(), "optimizer": opt.state_dict(), "epoch": epoch, "auc": auc}
            torch.save(state, os.path.join(ckpt_dir, f"epoch_{epoch}.pt"))
            if auc > best_auc:
                best_auc = auc
                torch.save(state, best_path)
        dist.barrier()

    if rank == 0:
        export_torchscript(args, best_path, os.path.join(args.workdir, "nfm_serving.pt"))
        log.info("exported best checkpoint (auc %.5f)", best_auc)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
