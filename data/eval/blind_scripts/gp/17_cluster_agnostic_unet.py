"""2D U-Net for organ segmentation; one launcher process per node, mp.spawn per GPU.

Works under Slurm and PBS without torchrun:

    Slurm: srun --ntasks-per-node=1 python unet_seg.py --config cfg/abdomen.yaml
    PBS:   pbsdsh -u /path/to/env/bin/python /path/to/unet_seg.py --config cfg/abdomen.yaml
"""
import argparse
import os
import socket
import subprocess
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
import yaml
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler


def discover_nodes():
    """Return (hosts, node_rank) for the current scheduler."""
    if "SLURM_JOB_NODELIST" in os.environ:
        hosts = subprocess.check_output(["scontrol", "show", "hostnames", os.environ["SLURM_JOB_NODELIST"]],
                                        text=True).split()
        return hosts, int(os.environ["SLURM_NODEID"])
    if "PBS_NODEFILE" in os.environ:
        with open(os.environ["PBS_NODEFILE"]) as f:
            hosts = list(dict.fromkeys(h.strip().split(".")[0] for h in f if h.strip()))
        return hosts, hosts.index(socket.gethostname().split(".")[0])
    return [socket.gethostname()], 0


def job_port():
    jid = os.environ.get("SLURM_JOB_ID") or os.environ.get("PBS_JOBID", "0").split(".")[0]
    return 21000 + int("".join(c for c in jid if c.isdigit()) or 0) % 20000


class SliceDataset(Dataset):
    def __init__(self, root, cases, augment):
        self.items = []
        for c in cases:
            d = np.load(os.path.join(root, f"{c}.npz"))
            for z in range(d["image"].shape[0]):
                self.items.append((c, z))
        self.root, self.augment, self._cache = root, augment, {}

    def _case(self, c):
        if c not in self._cache:
            d = np.load(os.path.join(self.root, f"{c}.npz"))
            self._cache = {c: (d["image"].astype(np.float32), d["label"].astype(np.int64))}
        return self._cache[c]

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        c, z = self.items[i]
        img, lbl = self._case(c)
        x, y = np.clip(img[z], -200, 300) / 250.0, lbl[z]
        if self.augment and np.random.rand() < 0.5:
            x, y = x[:, ::-1], y[:, ::-1]
        return torch.from_numpy(x.copy())[None], torch.from_numpy(y.copy())


def conv_block(cin, cout):
    return nn.Sequential(nn.Conv2d(cin, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(inplace=True),
                         nn.Conv2d(cout, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(inplace=True))


class UNet(nn.Module):
    def __init__(self, in_ch=1, n_cls=14, w=32):
        super().__init__()
        chs = [w, 2 * w, 4 * w, 8 * w, 16 * w]
        self.down = nn.ModuleList()
        c = in_ch
        for ch in chs:
            self.down.append(conv_block(c, ch))
            c = ch
        self.up = nn.ModuleList(nn.ConvTranspose2d(chs[i + 1], chs[i], 2, stride=2) for i in range(4))
        self.dec = nn.ModuleList(conv_block(2 * chs[i], chs[i]) for i in range(4))
        self.head = nn.Conv2d(chs[0], n_cls, 1)

    def forward(self, x):
        skips = []
        for i, blk in enumerate(self.down):
            x = blk(x)
            if i < 4:
                skips.append(x)
                x = F.max_pool2d(x, 2)
        for i in reversed(range(4)):
            x = self.dec[i](torch.cat([self.up[i](x), skips[i]], 1))
        return self.head(x)


def dice_loss(logits, target, n_cls, eps=1e-5):
    p = logits.softmax(1)
    oh = F.one_hot(target, n_cls).permute(0, 3, 1, 2).float()
    inter = (p * oh).sum((0, 2, 3))
    return 1 - ((2 * inter + eps) / (p.sum((0, 2, 3)) + oh.sum((0, 2, 3)) + eps)).mean()


def train_worker(local_rank, node_rank, nnodes, master_addr, master_port, cfg):
    ngpus = torch.cuda.device_count()
    rank, world = node_rank * ngpus + local_rank, nnodes * ngpus
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl", init_method=f"tcp://{master_addr}:{master_port}", rank=rank, world_size=world)
    device = torch.device("cuda", local_rank)
    n_cls = cfg["num_classes"]

    with open(cfg["split_file"]) as f:
        split = yaml.safe_load(f)
    train_ds = SliceDataset(cfg["data_root"], split["train"], augment=True)
    val_ds = SliceDataset(cfg["data_root"], split["val"], augment=False)
    sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    train_dl = DataLoader(train_ds, batch_size=cfg["batch_per_gpu"], sampler=sampler, num_workers=6,
                          pin_memory=True, drop_last=True)
    val_dl = DataLoader(Subset(val_ds, range(rank, len(val_ds), world)), batch_size=32, num_workers=4)

    model = nn.SyncBatchNorm.convert_sync_batchnorm(UNet(1, n_cls, cfg["width"])).to(device)
    model = DDP(model, device_ids=[local_rank])
    lr = cfg["lr"] * cfg["batch_per_gpu"] * world / cfg["ref_batch"]
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=1e-4)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=cfg["epochs"])

    if rank == 0:
        os.makedirs(cfg["out_dir"], exist_ok=True)
    best = 0.0
    for epoch in range(cfg["epochs"]):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for x, y in train_dl:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            logits = model(x)
            loss = F.cross_entropy(logits, y) + dice_loss(logits, y, n_cls)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
        sched.step()

        model.eval()
        inter = torch.zeros(n_cls, device=device)
        denom = torch.zeros(n_cls, device=device)
        with torch.no_grad():
            for x, y in val_dl:
                x, y = x.to(device), y.to(device)
                pred = F.one_hot(model.module(x).argmax(1), n_cls).permute(0, 3, 1, 2).float()
                oh = F.one_hot(y, n_cls).permute(0, 3, 1, 2).float()
                inter += (pred * oh).sum((0, 2, 3))
                denom += pred.sum((0, 2, 3)) + oh.sum((0, 2, 3))
        dist.all_reduce(inter)
        dist.all_reduce(denom)
        dice = (2 * inter[1:] / denom[1:].clamp(min=1)).mean().item()
        if rank == 0:
            print(f"epoch {epoch} loss {loss.item():.4f} val_dice {dice:.4f} {time.time() - t0:.0f}s", flush=True)
            torch.save({"model": model.module.state_dict(), "epoch": epoch, "dice": dice},
                       os.path.join(cfg["out_dir"], "last.pt"))
            if dice > best:
                best = dice
                torch.save(model.module.state_dict(), os.path.join(cfg["out_dir"], "best.pt"))
        dist.barrier()

    dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", required=True)
    args = ap.parse_args()
    with open(args.config) as f:
        cfg = yaml.safe_load(f)

    hosts, node_rank = discover_nodes()
    port = job_port()
    ngpus = torch.cuda.device_count()
    print(f"[{socket.gethostname()}] node {node_rank}/{len(hosts)}, {ngpus} GPUs, master {hosts[0]}:{port}",
          flush=True)
    mp.spawn(train_worker, args=(cfg, node_rank, len(hosts), hosts[0], port), nprocs=ngpus, join=True)


if __name__ == "__main__":
    main()
