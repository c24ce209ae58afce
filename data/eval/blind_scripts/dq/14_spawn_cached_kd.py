"""Offline KD on CIFAR-100 with mp.spawn (for the lab box where torchrun isn't set up).

WRN-40-4 teacher logits are precomputed once per (train image, flip) pair and
stored next to the data; each worker process computes its own shard of the
cache, rank 0 merges the shards into one file, and everybody then reads it.

    python 14_spawn_cached_kd.py --gpus 4 --teacher ckpt/wrn40_4_c100.pth
"""
import argparse
import datetime
import os
import socket
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler
from torchvision import datasets, transforms

from models.wrn import wide_resnet  # in-house WRN for 32x32 inputs

MEAN, STD = (0.5071, 0.4865, 0.4409), (0.2673, 0.2564, 0.2762)


class KDSet(Dataset):
    """CIFAR image + label + cached teacher logits for the flip actually applied."""

    def __init__(self, base, logits):
        self.base, self.logits = base, logits
        self.crop = transforms.RandomCrop(32, padding=4)

    def __len__(self):
        return len(self.base)

    def __getitem__(self, i):
        img, y = self.base[i]
        flip = torch.rand(()).item() < 0.5
        if flip:
            img = img.flip(-1)
        return self.crop(img), y, self.logits[i, int(flip)]


@torch.no_grad()
def teacher_shard_logits(teacher, base, indices, device):
    loader = DataLoader(Subset(base, indices), batch_size=500, shuffle=False, num_workers=2)
    out = []
    for x, _ in loader:
        x = x.to(device)
        out.append(torch.stack([teacher(x), teacher(x.flip(-1))], 1).float().cpu())
    return torch.cat(out)


def build_cache(teacher, base, path, rank, world, device):
    if os.path.exists(path):
        return
    idx = list(range(rank, len(base), world))
    part = teacher_shard_logits(teacher, base, idx, device)
    torch.save({"idx": torch.tensor(idx), "logits": part}, f"{path}.part{rank}")
    dist.barrier()
    if rank == 0:
        full = None
        for r in range(world):
            shard = torch.load(f"{path}.part{r}", map_location="cpu")
            if full is None:
                full = torch.empty(len(base), *shard["logits"].shape[1:])
            full[shard["idx"]] = shard["logits"]
            os.remove(f"{path}.part{r}")
        torch.save(full, path + ".tmp")
        os.replace(path + ".tmp", path)


def worker(local_rank, args, world_size):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(args.port)
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl", rank=local_rank, world_size=world_size,
                            timeout=datetime.timedelta(minutes=30))
    rank = dist.get_rank()
    device = torch.device("cuda", local_rank)

    norm = transforms.Compose([transforms.ToTensor(), transforms.Normalize(MEAN, STD)])
    if rank == 0:
        datasets.CIFAR100(args.data, train=True, download=True)
        datasets.CIFAR100(args.data, train=False, download=True)
    dist.barrier()
    base_train = datasets.CIFAR100(args.data, train=True, transform=norm)
    test_set = datasets.CIFAR100(args.data, train=False, transform=norm)

    teacher = wide_resnet(depth=40, widen=4, num_classes=100)
    teacher.load_state_dict(torch.load(args.teacher, map_location="cpu"))
    teacher.to(device).eval().requires_grad_(False)

    cache_path = os.path.join(args.data, "wrn40_4_logits.pt")
    build_cache(teacher, base_train, cache_path, rank, world_size, device)
    dist.barrier()
    logits = torch.load(cache_path, map_location="cpu")
    del teacher
    torch.cuda.empty_cache()

    train_set = KDSet(base_train, logits)
    sampler = DistributedSampler(train_set, num_replicas=world_size, rank=rank, shuffle=True)
    train_loader = DataLoader(train_set, batch_size=args.bs, sampler=sampler, num_workers=4,
                              pin_memory=True, drop_last=True, persistent_workers=True)
    test_loader = DataLoader(Subset(test_set, range(rank, len(test_set), world_size)),
                             batch_size=500, num_workers=2)

    student = wide_resnet(depth=16, widen=2, num_classes=100).to(device)
    student = DDP(student, device_ids=[local_rank])
    lr = args.lr * args.bs * world_size / 128
    opt = torch.optim.SGD(student.parameters(), lr=lr, momentum=0.9, weight_decay=5e-4, nesterov=True)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.epochs)

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
    best = 0.0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        student.train()
        t0 = time.time()
        for x, y, t in train_loader:
            x, y, t = x.to(device, non_blocking=True), y.to(device, non_blocking=True), t.to(device)
            s = student(x)
            kd = F.kl_div(F.log_softmax(s / args.T, 1), F.softmax(t / args.T, 1),
                          reduction="batchmean") * args.T ** 2
            loss = args.alpha * kd + (1 - args.alpha) * F.cross_entropy(s, y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
        sched.step()

        student.eval()
        acc = torch.zeros(2, device=device)
        with torch.no_grad():
            for x, y in test_loader:
                x, y = x.to(device), y.to(device)
                acc[0] += (student.module(x).argmax(1) == y).sum()
                acc[1] += y.numel()
        dist.all_reduce(acc)
        top1 = (acc[0] / acc[1]).item() * 100
        if rank == 0:
            print(f"epoch {epoch:3d} top1 {top1:.2f} ({time.time() - t0:.1f}s)", flush=True)
            torch.save({"model": student.module.state_dict(), "epoch": epoch},
                       os.path.join(args.out, "last.pth"))
            if top1 > best:
                best = top1
                torch.save(student.module.state_dict(), os.path.join(args.out, "best.pth"))
        dist.barrier()

    dist.destroy_process_group()


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--gpus", type=int, default=torch.cuda.device_count())
    parser.add_argument("--data", default="./data/cifar100")
    parser.add_argument("--teacher", required=True)
    parser.add_argument("--epochs", type=int, default=200)
    parser.add_argument("--bs", type=int, default=64)
    parser.add_argument("--lr", type=float, default=0.1, help="for a global batch of 128")
    parser.add_argument("--T", type=float, default=4.0)
    parser.add_argument("--alpha", type=float, default=0.9)
    parser.add_argument("--out", default="runs/wrn16_2_offline_kd")
    parser.add_argument("--port", type=int, default=0)
    args = parser.parse_args()
    if args.port == 0:
        args.port = free_port()
    mp.spawn(worker, args=(args, args.gpus), nprocs=args.gpus, join=True)
