"""SimCLR pre-training with torch.multiprocessing.spawn (one process per visible GPU).

    python simclr_spawn.py --data /data/stl10_unlabeled --batch-size 256 --epochs 500
    (multi-node: --nodes 2 --node-rank 0/1 --master-addr host0)
"""
import argparse
import json
import os
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
import torchvision
from PIL import Image
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torchvision import transforms


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--arch", default="resnet50")
    p.add_argument("--batch-size", type=int, default=256, help="per GPU")
    p.add_argument("--epochs", type=int, default=500)
    p.add_argument("--lr", type=float, default=0.3, help="per 256 images")
    p.add_argument("--wd", type=float, default=1e-6)
    p.add_argument("--temperature", type=float, default=0.2)
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--nodes", type=int, default=1)
    p.add_argument("--node-rank", type=int, default=0)
    p.add_argument("--master-addr", default="127.0.0.1")
    p.add_argument("--master-port", default="29517")
    p.add_argument("--out", default="runs/simclr")
    return p.parse_args()


class FileListDataset(Dataset):
    """Images listed in <root>/filelist.json, built once by rank 0."""

    def __init__(self, root, transform):
        with open(os.path.join(root, "filelist.json")) as f:
            self.files = json.load(f)
        self.transform = transform

    def __len__(self):
        return len(self.files)

    def __getitem__(self, i):
        img = Image.open(self.files[i]).convert("RGB")
        return self.transform(img), self.transform(img)


def build_filelist(root):
    files = []
    for dirpath, _, names in os.walk(root):
        files += [os.path.join(dirpath, n) for n in names if n.lower().endswith((".jpg", ".jpeg", ".png"))]
    tmp = os.path.join(root, "filelist.json.tmp")
    with open(tmp, "w") as f:
        json.dump(sorted(files), f)
    os.replace(tmp, os.path.join(root, "filelist.json"))


class GatherLayer(torch.autograd.Function):
    """all_gather that keeps gradients flowing back to every rank's own slice."""

    @staticmethod
    def forward(ctx, x):
        out = [torch.zeros_like(x) for _ in range(dist.get_world_size())]
        dist.all_gather(out, x)
        return tuple(out)

    @staticmethod
    def backward(ctx, *grads):
        all_grads = torch.stack(grads)
        dist.all_reduce(all_grads)
        return all_grads[dist.get_rank()]


class SimCLR(nn.Module):
    def __init__(self, arch, proj_dim=128):
        super().__init__()
        self.encoder = torchvision.models.__dict__[arch](weights=None)
        dim = self.encoder.fc.in_features
        self.encoder.fc = nn.Identity()
        self.projector = nn.Sequential(nn.Linear(dim, 2048, bias=False), nn.BatchNorm1d(2048), nn.ReLU(inplace=True),
                                       nn.Linear(2048, proj_dim, bias=False), nn.BatchNorm1d(proj_dim, affine=False))

    def forward(self, x1, x2):
        z = self.projector(self.encoder(torch.cat([x1, x2])))
        return F.normalize(z, dim=1).chunk(2)


def nt_xent(z1, z2, temperature):
    z1_all = torch.cat(GatherLayer.apply(z1))
    z2_all = torch.cat(GatherLayer.apply(z2))
    z = torch.cat([z1_all, z2_all])
    n = z1_all.shape[0]
    sim = z @ z.T / temperature
    sim.fill_diagonal_(float("-inf"))
    targets = torch.cat([torch.arange(n, 2 * n), torch.arange(0, n)]).to(z.device)
    return F.cross_entropy(sim, targets)


def worker(local_rank, args, ngpus_per_node):
    rank = args.node_rank * ngpus_per_node + local_rank
    world_size = args.nodes * ngpus_per_node
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl", init_method=f"tcp://{args.master_addr}:{args.master_port}",
                            world_size=world_size, rank=rank)
    device = torch.device("cuda", local_rank)

    if rank == 0 and not os.path.exists(os.path.join(args.data, "filelist.json")):
        build_filelist(args.data)
    dist.barrier()

    aug = transforms.Compose([
        transforms.RandomResizedCrop(96, scale=(0.2, 1.0)),
        transforms.RandomHorizontalFlip(),
        transforms.RandomApply([transforms.ColorJitter(0.4, 0.4, 0.4, 0.1)], p=0.8),
        transforms.RandomGrayscale(p=0.2),
        transforms.ToTensor(),
        transforms.Normalize((0.4467, 0.4398, 0.4066), (0.2603, 0.2566, 0.2713)),
    ])
    dataset = FileListDataset(args.data, aug)
    sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=True, drop_last=True)
    loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler, num_workers=args.workers,
                        pin_memory=True, drop_last=True, persistent_workers=True)

    model = SimCLR(args.arch)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).to(device)
    model = nn.parallel.DistributedDataParallel(model, device_ids=[local_rank])

    lr = args.lr * args.batch_size * world_size / 256
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9, weight_decay=args.wd)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.epochs * len(loader))
    scaler = torch.cuda.amp.GradScaler()

    start_epoch = 0
    ckpt_path = os.path.join(args.out, "checkpoint.pt")
    if os.path.exists(ckpt_path):
        ckpt = torch.load(ckpt_path, map_location={"cuda:0": f"cuda:{local_rank}"})
        model.module.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        scheduler.load_state_dict(ckpt["scheduler"])
        scaler.load_state_dict(ckpt["scaler"])
        start_epoch = ckpt["epoch"] + 1

    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        total = torch.zeros(2, device=device)
        for x1, x2 in loader:
            x1, x2 = x1.to(device, non_blocking=True), x2.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.float16):
                z1, z2 = model(x1, x2)
            loss = nt_xent(z1.float(), z2.float(), args.temperature)
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            scheduler.step()
            total += torch.stack([loss.detach(), torch.ones((), device=device)])
        dist.all_reduce(total)
        if rank == 0:
            print(f"epoch {epoch} loss {(total[0] / total[1]).item():.4f} lr {scheduler.get_last_lr()[0]:.4f} "
                  f"({time.time() - t0:.0f}s)", flush=True)
            torch.save({"epoch": epoch, "model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                        "scheduler": scheduler.state_dict(), "scaler": scaler.state_dict()}, ckpt_path + ".tmp")
            os.replace(ckpt_path + ".tmp", ckpt_path)
            if (epoch + 1) % 100 == 0:
                torch.save(model.module.encoder.state_dict(), os.path.join(args.out, f"encoder_ep{epoch + 1}.pt"))
        dist.barrier()

    dist.destroy_process_group()


def main():
    args = get_args()
    os.makedirs(args.out, exist_ok=True)
    ngpus_per_node = torch.cuda.device_count()
    mp.spawn(worker, args=(args, ngpus_per_node), nprocs=ngpus_per_node, join=True)


if __name__ == "__main__":
    main()
