"""IPNN click model, written to survive spot-instance preemption.

A checkpoint is written every --ckpt-every steps; when the job is restarted
with the same --run-dir it continues from the latest one.

    torchrun --nproc_per_node=8 07_ipnn_preemptible.py --run-dir /mnt/efs/runs/ipnn_0412
"""
import argparse
import glob
import os
import re
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torchmetrics.classification import BinaryAUROC


def cli():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", default="/mnt/efs/ctr/npy")
    ap.add_argument("--run-dir", required=True)
    ap.add_argument("--num-fields", type=int, default=39)
    ap.add_argument("--vocab", type=int, default=33_762_577)
    ap.add_argument("--dim", type=int, default=16)
    ap.add_argument("--hidden", default="1024,512,256")
    ap.add_argument("--batch", type=int, default=4096)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--ckpt-every", type=int, default=2000)
    ap.add_argument("--keep", type=int, default=3)
    return ap.parse_args()


class NpyCTR(Dataset):
    """{split}_x.npy: [N, num_fields] global feature ids (field offsets applied), {split}_y.npy: [N]."""

    def __init__(self, root, split):
        self.x = np.load(os.path.join(root, f"{split}_x.npy"), mmap_mode="r")
        self.y = np.load(os.path.join(root, f"{split}_y.npy"), mmap_mode="r")

    def __len__(self):
        return self.y.shape[0]

    def __getitem__(self, i):
        return self.x[i].astype(np.int64), np.float32(self.y[i])


class IPNN(nn.Module):
    def __init__(self, vocab, num_fields, dim, hidden):
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        nn.init.normal_(self.emb.weight, std=1e-4)
        rows, cols = torch.triu_indices(num_fields, num_fields, offset=1)
        self.register_buffer("rows", rows, persistent=False)
        self.register_buffer("cols", cols, persistent=False)
        d = num_fields * dim + rows.numel()
        layers = []
        for h in hidden:
            layers += [nn.Linear(d, h), nn.LayerNorm(h), nn.ReLU(), nn.Dropout(0.1)]
            d = h
        layers.append(nn.Linear(d, 1))
        self.mlp = nn.Sequential(*layers)

    def forward(self, x):
        e = self.emb(x)                                        # B, F, D
        ip = (e[:, self.rows] * e[:, self.cols]).sum(-1)       # B, F(F-1)/2
        return self.mlp(torch.cat([e.flatten(1), ip], dim=1)).squeeze(1)


def latest_checkpoint(run_dir):
    ckpts = glob.glob(os.path.join(run_dir, "ckpt_*.pt"))
    if not ckpts:
        return None
    return max(ckpts, key=lambda p: int(re.search(r"ckpt_(\d+)\.pt", p).group(1)))


def save_checkpoint(run_dir, keep, model, opt, epoch, step, batch_in_epoch):
    path = os.path.join(run_dir, f"ckpt_{step:08d}.pt")
    torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(),
                "epoch": epoch, "step": step, "batch_in_epoch": batch_in_epoch}, path + ".tmp")
    os.replace(path + ".tmp", path)
    old = sorted(glob.glob(os.path.join(run_dir, "ckpt_*.pt")))[:-keep]
    for p in old:
        os.remove(p)


@torch.no_grad()
def validate(model, loader, device):
    model.eval()
    auroc = BinaryAUROC(thresholds=None).to(device)
    loss_sum = torch.zeros(2, device=device)
    for x, y in loader:
        x, y = x.to(device), y.to(device)
        logits = model(x)
        loss_sum[0] += F.binary_cross_entropy_with_logits(logits, y, reduction="sum")
        loss_sum[1] += y.numel()
        auroc.update(torch.sigmoid(logits), y.long())
    auc = auroc.compute()  # torchmetrics syncs the states across ranks here
    dist.all_reduce(loss_sum)
    model.train()
    return auc.item(), (loss_sum[0] / loss_sum[1]).item()


def main():
    args = cli()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    device = torch.device("cuda", local_rank)

    train_ds = NpyCTR(args.data, "train")
    valid_ds = NpyCTR(args.data, "valid")
    sampler = DistributedSampler(train_ds, shuffle=True, seed=0)
    loader = DataLoader(train_ds, batch_size=args.batch, sampler=sampler, num_workers=8,
                        pin_memory=True, drop_last=True, persistent_workers=True)
    vloader = DataLoader(valid_ds, batch_size=16384, num_workers=4, pin_memory=True,
                         sampler=DistributedSampler(valid_ds, shuffle=False))

    model = IPNN(args.vocab, args.num_fields, args.dim, [int(h) for h in args.hidden.split(",")]).to(device)
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)

    start_epoch, step, skip = 0, 0, 0
    ckpt_path = latest_checkpoint(args.run_dir)
    if ckpt_path is not None:
        ckpt = torch.load(ckpt_path)
        model.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["opt"])
        start_epoch, step, skip = ckpt["epoch"], ckpt["step"], ckpt["batch_in_epoch"]
        if rank == 0:
            print(f"resumed from {ckpt_path} (epoch {start_epoch}, step {step})", flush=True)
        del ckpt

    model = DDP(model, device_ids=[local_rank])
    if rank == 0:
        os.makedirs(args.run_dir, exist_ok=True)

    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)
        t0 = time.time()
        for b, (x, y) in enumerate(loader):
            if b < skip:
                continue  # same permutation as before the restart, fast-forward
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            loss = F.binary_cross_entropy_with_logits(model(x), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            step += 1

            if rank == 0 and step % 100 == 0:
                print(f"epoch {epoch} step {step} loss {loss.item():.5f} "
                      f"({100 * args.batch * dist.get_world_size() / (time.time() - t0):.0f} ex/s)", flush=True)
                t0 = time.time()
            if step % args.ckpt_every == 0:
                if rank == 0:
                    save_checkpoint(args.run_dir, args.keep, model, opt, epoch, step, b + 1)
                dist.barrier()
        skip = 0

        auc, ll = validate(model, vloader, device)
        if rank == 0:
            print(f"epoch {epoch} valid auc {auc:.5f} logloss {ll:.5f}", flush=True)
            save_checkpoint(args.run_dir, args.keep, model, opt, epoch + 1, step, 0)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
