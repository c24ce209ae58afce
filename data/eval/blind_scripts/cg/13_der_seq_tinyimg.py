"""DER++ on Seq-TinyImageNet (10 tasks x 20 classes), class-IL, DDP + AMP + grad accumulation.

Every rank keeps its own reservoir buffer (capacity buffer_size / world) over the part of the
stream it sees. Current and replayed samples go through the network in one forward pass.
Buffers are checkpointed per rank, so a resume needs the same number of processes.

    torchrun --nproc_per_node=4 13_der_seq_tinyimg.py --root /data/tiny-imagenet-200 \
        --buffer-size 5120 --accum-steps 2 --out runs/derpp_tiny
"""
import argparse
import contextlib
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torchvision import transforms
from torchvision.datasets import ImageFolder
from torchvision.models import resnet18

N_TASKS, N_CLASSES = 10, 200
MEAN = torch.tensor([0.4802, 0.4480, 0.3975]).view(1, 3, 1, 1)
STD = torch.tensor([0.2770, 0.2691, 0.2821]).view(1, 3, 1, 1)


class TinyTask(Dataset):
    def __init__(self, folder, idx, train):
        self.folder, self.idx, self.train = folder, idx, train
        self.aug = transforms.Compose([transforms.RandomCrop(64, padding=4),
                                       transforms.RandomHorizontalFlip()])
        self.to_t = transforms.ToTensor()

    def __len__(self):
        return len(self.idx)

    def __getitem__(self, i):
        img, y = self.folder[int(self.idx[i])]
        raw = self.to_t(img)
        return (self.aug(raw) if self.train else raw), y, raw


class Buffer:
    def __init__(self, capacity, device, seed):
        self.cap, self.n_seen = capacity, 0
        self.x = torch.empty(capacity, 3, 64, 64, dtype=torch.uint8, device=device)
        self.y = torch.empty(capacity, dtype=torch.long, device=device)
        self.z = torch.empty(capacity, N_CLASSES, dtype=torch.float16, device=device)
        self.g = torch.Generator(device="cpu").manual_seed(seed)

    def __len__(self):
        return min(self.n_seen, self.cap)

    def add(self, x, y, z):
        for i in range(x.size(0)):
            j = self.n_seen if self.n_seen < self.cap else int(torch.randint(self.n_seen + 1, (1,), generator=self.g))
            if j < self.cap:
                self.x[j] = (x[i] * 255).round().to(torch.uint8)
                self.y[j], self.z[j] = y[i], z[i].half()
            self.n_seen += 1

    def sample(self, n):
        j = torch.randint(len(self), (n,), generator=self.g).to(self.x.device)
        x = self.x[j].float().div_(255)
        flip = torch.rand(n, device=x.device) < 0.5
        x[flip] = x[flip].flip(3)
        return x, self.y[j], self.z[j].float()

    def state_dict(self):
        return {"x": self.x.cpu(), "y": self.y.cpu(), "z": self.z.cpu(), "n_seen": self.n_seen,
                "g": self.g.get_state()}

    def load_state_dict(self, s):
        self.x.copy_(s["x"]), self.y.copy_(s["y"]), self.z.copy_(s["z"])
        self.n_seen = s["n_seen"]
        self.g.set_state(s["g"])


def norm(x):
    return (x - MEAN.to(x.device)) / STD.to(x.device)


@torch.no_grad()
def eval_seen(net, val, val_y, t, device, rank, world):
    net.eval()
    accs = []
    for j in range(t + 1):
        idx = np.flatnonzero((val_y >= 20 * j) & (val_y < 20 * (j + 1)))[rank::world]
        s = torch.zeros(2, device=device)
        for x, y, _ in DataLoader(TinyTask(val, idx, False), batch_size=250, num_workers=4):
            x, y = x.to(device), y.to(device)
            s[0] += (net(norm(x))[:, : 20 * (t + 1)].argmax(1) == y).sum()
            s[1] += y.numel()
        dist.all_reduce(s)
        accs.append((100 * s[0] / s[1]).item())
    net.train()
    return accs


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", required=True)
    ap.add_argument("--out", default="runs/derpp_tiny")
    ap.add_argument("--buffer-size", type=int, default=5120)
    ap.add_argument("--alpha", type=float, default=0.1)
    ap.add_argument("--beta", type=float, default=0.5)
    ap.add_argument("--lr", type=float, default=0.03)
    ap.add_argument("--epochs", type=int, default=100)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--accum-steps", type=int, default=1)
    ap.add_argument("--resume-task", type=int, default=-1)
    args = ap.parse_args()

    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dev = torch.device("cuda", local_rank)
    torch.manual_seed(0)

    train = ImageFolder(os.path.join(args.root, "train"))
    val = ImageFolder(os.path.join(args.root, "val"))
    train_y, val_y = np.asarray(train.targets), np.asarray(val.targets)

    net = resnet18(num_classes=N_CLASSES)
    net.maxpool = nn.Identity()
    net = net.to(dev)
    buf = Buffer(args.buffer_size // world, dev, seed=1000 + rank)
    R = np.zeros((N_TASKS, N_TASKS))
    start = 0
    if args.resume_task >= 0:
        ck = torch.load(os.path.join(args.out, f"task{args.resume_task}.pt"), map_location="cpu")
        assert ck["world_size"] == world, "buffers were saved per rank; resume with the same world size"
        net.load_state_dict(ck["model"])
        R = ck["R"]
        buf.load_state_dict(torch.load(os.path.join(args.out, f"buffer_t{args.resume_task}_r{rank}.pt"),
                                       map_location="cpu"))
        start = args.resume_task + 1

    model = DDP(net, device_ids=[local_rank])
    # --lr is tuned for a batch of 32; scale linearly with the global batch
    lr = args.lr * args.batch_size * world * args.accum_steps / 32
    scaler = torch.cuda.amp.GradScaler()
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)

    for t in range(start, N_TASKS):
        ds = TinyTask(train, np.flatnonzero((train_y >= 20 * t) & (train_y < 20 * (t + 1))), True)
        sampler = DistributedSampler(ds, shuffle=True, seed=t)
        loader = DataLoader(ds, batch_size=args.batch_size, sampler=sampler, num_workers=6,
                            pin_memory=True, drop_last=True)
        opt = torch.optim.SGD(model.parameters(), lr=lr)
        n_upd = len(loader) // args.accum_steps * args.accum_steps
        tic = time.time()
        for ep in range(args.epochs):
            sampler.set_epoch(ep)
            opt.zero_grad(set_to_none=True)
            for it, (x, y, raw) in enumerate(loader):
                if it >= n_upd:
                    break
                x, y, raw = x.to(dev, non_blocking=True), y.to(dev, non_blocking=True), raw.to(dev)
                bsz = x.size(0)
                replay = len(buf) > 0
                if replay:
                    bx1, _, bz1 = buf.sample(bsz)
                    bx2, by2, _ = buf.sample(bsz)
                    x_all = torch.cat([x, bx1, bx2])
                else:
                    x_all = x
                last_micro = (it + 1) % args.accum_steps == 0
                ctx = model.no_sync() if not last_micro else contextlib.nullcontext()
                with ctx:
                    with torch.autocast("cuda", dtype=torch.float16):
                        out = model(norm(x_all))
                    out = out.float()
                    loss = F.cross_entropy(out[:bsz], y)
                    if replay:
                        loss = loss + args.alpha * F.mse_loss(out[bsz:2 * bsz], bz1)
                        loss = loss + args.beta * F.cross_entropy(out[2 * bsz:], by2)
                    scaler.scale(loss / args.accum_steps).backward()
                if last_micro:
                    scaler.step(opt)
                    scaler.update()
                    opt.zero_grad(set_to_none=True)
                buf.add(raw, y, out[:bsz].detach())
            if rank == 0 and ep % 10 == 0:
                print(f"t{t} ep{ep} loss {loss.item():.4f} buf {len(buf)} {time.time() - tic:.0f}s", flush=True)

        R[t, : t + 1] = eval_seen(net, val, val_y, t, dev, rank, world)
        torch.save(buf.state_dict(), os.path.join(args.out, f"buffer_t{t}_r{rank}.pt"))
        if rank == 0:
            fwt = R[t, : t + 1].mean()
            fgt = np.mean([R[j:t, j].max() - R[t, j] for j in range(t)]) if t else 0.0
            print(f"== task {t}: mean acc {fwt:.2f}, forgetting {fgt:.2f}", flush=True)
            torch.save({"model": net.state_dict(), "R": R, "world_size": world},
                       os.path.join(args.out, f"task{t}.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
