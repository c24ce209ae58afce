"""Weight-sharing supernet (SPOS, ShuffleNetV2 choice blocks) on CIFAR-100, resumable.

Per step one path is sampled; every rank samples the same path from a
generator seeded with the global step, so the step trains one sub-network on
the global batch.  The three unused choices of every layer get no gradient,
hence find_unused_parameters.

    torchrun --standalone --nproc_per_node=4 11_spos_cifar_supernet_resume.py --resume auto
"""
import argparse
import glob
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Subset
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter
from torchvision import datasets, transforms


def channel_shuffle(x):
    b, c, h, w = x.shape
    x = x.reshape(b * c // 2, 2, h * w).permute(1, 0, 2).reshape(2, -1, c // 2, h, w)
    return x[0], x[1]


class ShuffleUnit(nn.Module):
    def __init__(self, cin, cout, stride, kernel, xception=False):
        super().__init__()
        self.stride = stride
        branch_in = cin if stride == 2 else cin // 2
        out = cout - branch_in
        mid = cout // 2
        pad = kernel // 2
        if xception:
            layers = [nn.Conv2d(branch_in, branch_in, 3, stride, 1, groups=branch_in, bias=False), nn.BatchNorm2d(branch_in),
                      nn.Conv2d(branch_in, mid, 1, bias=False), nn.BatchNorm2d(mid), nn.ReLU(inplace=True),
                      nn.Conv2d(mid, mid, 3, 1, 1, groups=mid, bias=False), nn.BatchNorm2d(mid),
                      nn.Conv2d(mid, mid, 1, bias=False), nn.BatchNorm2d(mid), nn.ReLU(inplace=True),
                      nn.Conv2d(mid, mid, 3, 1, 1, groups=mid, bias=False), nn.BatchNorm2d(mid),
                      nn.Conv2d(mid, out, 1, bias=False), nn.BatchNorm2d(out), nn.ReLU(inplace=True)]
        else:
            layers = [nn.Conv2d(branch_in, mid, 1, bias=False), nn.BatchNorm2d(mid), nn.ReLU(inplace=True),
                      nn.Conv2d(mid, mid, kernel, stride, pad, groups=mid, bias=False), nn.BatchNorm2d(mid),
                      nn.Conv2d(mid, out, 1, bias=False), nn.BatchNorm2d(out), nn.ReLU(inplace=True)]
        self.main = nn.Sequential(*layers)
        if stride == 2:
            self.proj = nn.Sequential(nn.Conv2d(cin, cin, kernel, 2, pad, groups=cin, bias=False), nn.BatchNorm2d(cin),
                                      nn.Conv2d(cin, cin, 1, bias=False), nn.BatchNorm2d(cin), nn.ReLU(inplace=True))

    def forward(self, x):
        if self.stride == 1:
            a, b = channel_shuffle(x)
            return torch.cat([a, self.main(b)], 1)
        return torch.cat([self.proj(x), self.main(x)], 1)


class Supernet(nn.Module):
    stage_repeats = [4, 4, 8, 4]
    stage_channels = [64, 160, 320, 640]
    n_choices = 4

    def __init__(self, num_classes=100):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 16, 3, 1, 1, bias=False), nn.BatchNorm2d(16), nn.ReLU(inplace=True))
        layers, cin = [], 16
        for i, (n, c) in enumerate(zip(self.stage_repeats, self.stage_channels)):
            for j in range(n):
                stride = 2 if j == 0 and i > 0 else 1
                layers.append(nn.ModuleList([ShuffleUnit(cin, c, stride, 3), ShuffleUnit(cin, c, stride, 5),
                                             ShuffleUnit(cin, c, stride, 7), ShuffleUnit(cin, c, stride, 3, xception=True)]))
                cin = c
        self.features = nn.ModuleList(layers)
        self.last = nn.Sequential(nn.Conv2d(cin, 1024, 1, bias=False), nn.BatchNorm2d(1024), nn.ReLU(inplace=True))
        self.classifier = nn.Linear(1024, num_classes)

    def forward(self, x, path):
        x = self.stem(x)
        for choices, idx in zip(self.features, path):
            x = choices[idx](x)
        x = F.adaptive_avg_pool2d(self.last(x), 1).flatten(1)
        return self.classifier(x)


def sample_path(step, seed, n_layers, n_choices):
    g = torch.Generator().manual_seed(seed * 100003 + step)
    return torch.randint(n_choices, (n_layers,), generator=g).tolist()


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", default="./data")
    ap.add_argument("--workdir", default="./runs/spos_c100")
    ap.add_argument("--epochs", type=int, default=200)
    ap.add_argument("--bs", type=int, default=128, help="per-GPU batch size")
    ap.add_argument("--base-lr", type=float, default=0.1, help="lr for a global batch of 256")
    ap.add_argument("--wd", type=float, default=5e-4)
    ap.add_argument("--resume", default="", help="checkpoint path or 'auto'")
    ap.add_argument("--seed", type=int, default=3)
    return ap.parse_args()


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{local_rank}")
    torch.manual_seed(args.seed)

    mean, std = (0.5071, 0.4865, 0.4409), (0.2673, 0.2564, 0.2762)
    train_tf = transforms.Compose([transforms.RandomCrop(32, 4), transforms.RandomHorizontalFlip(), transforms.ToTensor(),
                                   transforms.Normalize(mean, std)])
    test_tf = transforms.Compose([transforms.ToTensor(), transforms.Normalize(mean, std)])
    if rank == 0:
        datasets.CIFAR100(args.data, train=True, download=True)
        datasets.CIFAR100(args.data, train=False, download=True)
    dist.barrier()
    train_set = datasets.CIFAR100(args.data, train=True, transform=train_tf)
    test_set = datasets.CIFAR100(args.data, train=False, transform=test_tf)
    sampler = DistributedSampler(train_set, shuffle=True, seed=args.seed, drop_last=True)
    train_loader = DataLoader(train_set, args.bs, sampler=sampler, num_workers=6, pin_memory=True, drop_last=True)
    test_loader = DataLoader(Subset(test_set, range(rank, len(test_set), world)), 500, num_workers=4)

    net = Supernet().to(device).to(memory_format=torch.channels_last)
    model = DDP(net, device_ids=[local_rank], find_unused_parameters=True)
    lr = args.base_lr * args.bs * world / 256
    opt = torch.optim.SGD(net.parameters(), lr=lr, momentum=0.9, weight_decay=args.wd, nesterov=True)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, args.epochs * len(train_loader))
    scaler = torch.cuda.amp.GradScaler()
    n_layers = len(net.features)

    start_epoch = 0
    resume = args.resume
    if resume == "auto":
        found = sorted(glob.glob(os.path.join(args.workdir, "ckpt_*.pt")))
        resume = found[-1] if found else ""
    if resume:
        ckpt = torch.load(resume, map_location=device)
        net.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["opt"])
        sched.load_state_dict(ckpt["sched"])
        scaler.load_state_dict(ckpt["scaler"])
        start_epoch = ckpt["epoch"] + 1

    writer = SummaryWriter(args.workdir) if rank == 0 else None
    crit = nn.CrossEntropyLoss()
    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        tic, loss_acc = time.time(), torch.zeros((), device=device)
        for i, (x, y) in enumerate(train_loader):
            step = epoch * len(train_loader) + i
            x = x.to(device, non_blocking=True).to(memory_format=torch.channels_last)
            y = y.to(device, non_blocking=True)
            path = sample_path(step, args.seed, n_layers, net.n_choices)
            with torch.autocast("cuda", dtype=torch.float16):
                loss = crit(model(x, path), y)
            opt.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            sched.step()
            loss_acc += loss.detach()
        dist.all_reduce(loss_acc, op=dist.ReduceOp.AVG)

        # quick supernet health check on three fixed paths
        model.eval()
        accs = []
        with torch.no_grad():
            for k in range(3):
                path = sample_path(10**7 + k, args.seed, n_layers, net.n_choices)
                hit = torch.zeros(2, device=device)
                for x, y in test_loader:
                    x, y = x.to(device).to(memory_format=torch.channels_last), y.to(device)
                    hit[0] += (net(x, path).argmax(1) == y).sum()
                    hit[1] += y.numel()
                dist.all_reduce(hit)
                accs.append((hit[0] / hit[1]).item())

        if rank == 0:
            writer.add_scalar("train/loss", loss_acc.item() / len(train_loader), epoch)
            writer.add_scalar("eval/mean_path_acc", sum(accs) / 3, epoch)
            print(f"ep {epoch} loss {loss_acc.item() / len(train_loader):.3f} accs {accs} {time.time() - tic:.0f}s",
                  flush=True)
            if epoch % 10 == 9 or epoch == args.epochs - 1:
                torch.save({"epoch": epoch, "model": net.state_dict(), "opt": opt.state_dict(),
                            "sched": sched.state_dict(), "scaler": scaler.state_dict()},
                           os.path.join(args.workdir, f"ckpt_{epoch:04d}.pt"))
        dist.barrier()

    if writer is not None:
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
