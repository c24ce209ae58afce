#!/usr/bin/env python3
"""Multi-label chest X-ray classifier (DenseNet-121), PBS/Torque + torchrun.

    #PBS -N cxr-densenet
    #PBS -l nodes=3:ppn=8:gpus=4
    #PBS -l walltime=12:00:00
    #PBS -j oe
    cd $PBS_O_WORKDIR
    pbsdsh -u $PBS_O_WORKDIR/env/bin/python $PBS_O_WORKDIR/cxr_train.py --csv /shared/cxr/labels.csv \
        --images /shared/cxr/images --out /shared/cxr/runs/densenet

pbsdsh -u runs this file once per node; each copy starts torchrun for its node.
"""
import argparse
import os
import socket
import subprocess
import sys
import time

import pandas as pd
import torch
import torch.distributed as dist
import torch.nn as nn
import torchvision
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler
from torchvision import transforms as T

FINDINGS = ["Atelectasis", "Cardiomegaly", "Consolidation", "Edema", "Effusion", "Emphysema", "Fibrosis",
            "Hernia", "Infiltration", "Mass", "Nodule", "Pleural_Thickening", "Pneumonia", "Pneumothorax"]


def node_launch(argv, gpus_per_node, port):
    with open(os.environ["PBS_NODEFILE"]) as f:
        nodes = list(dict.fromkeys(l.strip() for l in f if l.strip()))
    me = socket.getfqdn()
    node_rank = next(i for i, n in enumerate(nodes) if n.split(".")[0] == me.split(".")[0])
    cmd = [sys.executable, "-m", "torch.distributed.run",
           f"--nnodes={len(nodes)}", f"--node_rank={node_rank}", f"--nproc_per_node={gpus_per_node}",
           f"--master_addr={nodes[0]}", f"--master_port={port}",
           os.path.abspath(__file__), "--worker", *argv]
    print(f"{me}: node {node_rank}/{len(nodes)} -> {nodes[0]}:{port}", flush=True)
    return subprocess.call(cmd)


class CXR(Dataset):
    def __init__(self, df, root, tf):
        self.paths = [os.path.join(root, p) for p in df["Image Index"]]
        self.y = torch.tensor(df[FINDINGS].values, dtype=torch.float32)
        self.tf = tf

    def __len__(self):
        return len(self.paths)

    def __getitem__(self, i):
        return self.tf(Image.open(self.paths[i]).convert("RGB")), self.y[i]


@torch.no_grad()
def evaluate(model, loader, device, thr=0.5):
    model.eval()
    tp = fp = fn = 0
    loss_sum, n = 0.0, 0
    bce = nn.BCEWithLogitsLoss(reduction="sum")
    for x, y in loader:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        logits = model(x)
        loss_sum += bce(logits, y).item()
        n += y.numel()
        pred = (logits.sigmoid() > thr).float()
        tp += (pred * y).sum().item()
        fp += (pred * (1 - y)).sum().item()
        fn += ((1 - pred) * y).sum().item()
    stats = torch.tensor([tp, fp, fn, loss_sum, n], dtype=torch.float64)
    dist.all_reduce(stats)
    tp, fp, fn, loss_sum, n = stats.tolist()
    f1 = 2 * tp / max(1.0, 2 * tp + fp + fn)
    return loss_sum / n, f1


def worker(args):
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    df = pd.read_csv(args.csv)
    # patient-level split stored in the csv, identical on every rank
    train_df, val_df = df[df["split"] == "train"], df[df["split"] == "val"]
    norm = T.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])
    train_ds = CXR(train_df, args.images, T.Compose([T.RandomResizedCrop(320, scale=(0.8, 1.0)),
                                                     T.RandomRotation(7), T.ToTensor(), norm]))
    val_ds = CXR(val_df, args.images, T.Compose([T.Resize(320), T.CenterCrop(320), T.ToTensor(), norm]))
    sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    train_dl = DataLoader(train_ds, batch_size=args.batch, sampler=sampler, num_workers=8, pin_memory=True,
                          drop_last=True, persistent_workers=True)
    val_dl = DataLoader(Subset(val_ds, range(rank, len(val_ds), world)), batch_size=64, num_workers=8)

    net = torchvision.models.densenet121(weights="IMAGENET1K_V1")
    net.classifier = nn.Linear(net.classifier.in_features, len(FINDINGS))
    net = nn.SyncBatchNorm.convert_sync_batchnorm(net).to(device)
    net = DDP(net, device_ids=[local_rank])

    pos = torch.tensor(train_df[FINDINGS].values.mean(0), dtype=torch.float32)
    crit = nn.BCEWithLogitsLoss(pos_weight=((1 - pos) / pos.clamp(min=1e-3)).clamp(max=20).to(device))
    lr = args.lr * args.batch * world / 256
    opt = torch.optim.AdamW(net.parameters(), lr=lr, weight_decay=1e-4)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.epochs * len(train_dl))

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
    best = -1.0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        net.train()
        t0 = time.time()
        for step, (x, y) in enumerate(train_dl):
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = net(x)
            loss = crit(logits.float(), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            if rank == 0 and step % 50 == 0:
                print(f"epoch {epoch} step {step}/{len(train_dl)} loss {loss.item():.4f}", flush=True)

        val_loss, f1 = evaluate(net.module, val_dl, device)
        if rank == 0:
            print(f"epoch {epoch} val_loss {val_loss:.4f} micro-F1 {f1:.4f} ({time.time() - t0:.0f}s)", flush=True)
            torch.save({"model": net.module.state_dict(), "opt": opt.state_dict(), "epoch": epoch},
                       os.path.join(args.out, "last.pt"))
            if f1 > best:
                best = f1
                torch.save(net.module.state_dict(), os.path.join(args.out, "best.pt"))
        dist.barrier()

    dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--worker", action="store_true")
    ap.add_argument("--csv", required=True)
    ap.add_argument("--images", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--epochs", type=int, default=30)
    ap.add_argument("--batch", type=int, default=32, help="per GPU")
    ap.add_argument("--lr", type=float, default=1e-4, help="for a global batch of 256")
    ap.add_argument("--gpus-per-node", type=int, default=4)
    ap.add_argument("--port", type=int, default=29488)
    args, _ = ap.parse_known_args()
    if args.worker:
        worker(args)
    else:
        sys.exit(node_launch(sys.argv[1:], args.gpus_per_node, args.port))


if __name__ == "__main__":
    main()
