"""AdaFace on VGGFace2 (aligned 112x112 folders), single node, started with mp.spawn.

    python 12_adaface_spawn_vggface2.py --data /data/vggface2_112 --gpus 8
"""
import argparse
import math
import os
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.checkpoint import checkpoint
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from torchvision import datasets, transforms


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data", default="/data/vggface2_112")
    p.add_argument("--val", default="/data/vggface2_112_val")
    p.add_argument("--gpus", type=int, default=torch.cuda.device_count())
    p.add_argument("--port", default="29517")
    p.add_argument("--batch-size", type=int, default=96)
    p.add_argument("--lr", type=float, default=0.1)
    p.add_argument("--epochs", type=int, default=26)
    p.add_argument("--milestones", type=int, nargs="+", default=[12, 20, 24])
    p.add_argument("--m", type=float, default=0.4)
    p.add_argument("--h", type=float, default=0.333)
    p.add_argument("--grad-ckpt", action="store_true")
    p.add_argument("--out", default="experiments/adaface_vgg2")
    p.add_argument("--resume", default="")
    return p.parse_args()


class BottleneckIR(nn.Module):
    def __init__(self, cin, depth, stride):
        super().__init__()
        self.shortcut = (nn.MaxPool2d(1, stride) if cin == depth else
                         nn.Sequential(nn.Conv2d(cin, depth, 1, stride, bias=False), nn.BatchNorm2d(depth)))
        self.res = nn.Sequential(nn.BatchNorm2d(cin), nn.Conv2d(cin, depth, 3, 1, 1, bias=False),
                                 nn.BatchNorm2d(depth), nn.PReLU(depth),
                                 nn.Conv2d(depth, depth, 3, stride, 1, bias=False), nn.BatchNorm2d(depth))

    def forward(self, x):
        return self.res(x) + self.shortcut(x)


class IR50(nn.Module):
    def __init__(self, emb=512, grad_ckpt=False):
        super().__init__()
        self.grad_ckpt = grad_ckpt
        self.stem = nn.Sequential(nn.Conv2d(3, 64, 3, 1, 1, bias=False), nn.BatchNorm2d(64), nn.PReLU(64))
        stages, cin = [], 64
        for depth, n in [(64, 3), (128, 4), (256, 14), (512, 3)]:
            blocks = [BottleneckIR(cin, depth, 2)] + [BottleneckIR(depth, depth, 1) for _ in range(n - 1)]
            stages.append(nn.Sequential(*blocks))
            cin = depth
        self.stages = nn.ModuleList(stages)
        self.out = nn.Sequential(nn.BatchNorm2d(512), nn.Dropout(0.4), nn.Flatten(),
                                 nn.Linear(512 * 7 * 7, emb), nn.BatchNorm1d(emb, affine=False))

    def forward(self, x):
        x = self.stem(x)
        for stage in self.stages:
            # non-reentrant checkpointing is safe with DDP's autograd hooks
            x = checkpoint(stage, x, use_reentrant=False) if self.grad_ckpt and self.training else stage(x)
        return self.out(x)


class AdaFace(nn.Module):
    def __init__(self, emb, classes, m=0.4, h=0.333, s=64.0, t_alpha=0.01):
        super().__init__()
        self.kernel = nn.Parameter(torch.empty(emb, classes).uniform_(-1, 1).renorm_(2, 1, 1e-5).mul_(1e5))
        self.m, self.h, self.s, self.t_alpha, self.eps = m, h, s, t_alpha, 1e-3
        self.register_buffer("batch_mean", torch.ones(1) * 20)
        self.register_buffer("batch_std", torch.ones(1) * 100)

    def forward(self, emb, label):
        norms = emb.norm(p=2, dim=1, keepdim=True)
        emb = emb / norms
        cosine = (emb @ F.normalize(self.kernel, dim=0)).clamp(-1 + self.eps, 1 - self.eps)
        safe_norms = norms.clamp(0.001, 100).detach()
        with torch.no_grad():
            self.batch_mean.mul_(1 - self.t_alpha).add_(safe_norms.mean() * self.t_alpha)
            self.batch_std.mul_(1 - self.t_alpha).add_(safe_norms.std() * self.t_alpha)
        scaler = ((safe_norms - self.batch_mean) / (self.batch_std + self.eps) * self.h).clamp(-1, 1)
        one_hot = F.one_hot(label, cosine.size(1)).to(cosine.dtype)
        theta = cosine.acos()
        theta_m = (theta + one_hot * (-self.m * scaler)).clamp(self.eps, math.pi - self.eps)
        cosine = theta_m.cos() - one_hot * (self.m + self.m * scaler)
        return cosine * self.s


class Net(nn.Module):
    def __init__(self, classes, args):
        super().__init__()
        self.backbone = IR50(grad_ckpt=args.grad_ckpt)
        self.head = AdaFace(512, classes, m=args.m, h=args.h)

    def forward(self, x, y):
        emb = self.backbone(x)
        with torch.autocast("cuda", enabled=False):
            return self.head(emb.float(), y)


def worker(local_rank, ngpus, args):
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", args.port)
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl", rank=local_rank, world_size=ngpus)
    device = torch.device("cuda", local_rank)
    main_proc = local_rank == 0

    tf = transforms.Compose([transforms.RandomHorizontalFlip(), transforms.ToTensor(),
                             transforms.Normalize([0.5] * 3, [0.5] * 3)])
    train_set = datasets.ImageFolder(args.data, tf)
    val_set = datasets.ImageFolder(args.val, transforms.Compose([transforms.ToTensor(), transforms.Normalize([0.5] * 3, [0.5] * 3)]))
    assert val_set.classes == train_set.classes
    sampler = DistributedSampler(train_set, num_replicas=ngpus, rank=local_rank, shuffle=True)
    val_sampler = DistributedSampler(val_set, num_replicas=ngpus, rank=local_rank, shuffle=False, drop_last=True)
    loader = DataLoader(train_set, args.batch_size, sampler=sampler, num_workers=8, pin_memory=True,
                        drop_last=True, persistent_workers=True)
    val_loader = DataLoader(val_set, 256, sampler=val_sampler, num_workers=4)

    model = Net(len(train_set.classes), args)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).to(device)
    model = DDP(model, device_ids=[local_rank])
    lr = args.lr * args.batch_size * ngpus / 512
    decay, no_decay = [], []
    for n, p in model.named_parameters():
        (no_decay if p.ndim == 1 else decay).append(p)
    optimizer = torch.optim.SGD([{"params": decay, "weight_decay": 5e-4}, {"params": no_decay, "weight_decay": 0}],
                                lr=lr, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.MultiStepLR(optimizer, [e * len(loader) for e in args.milestones], 0.1)
    scaler = torch.cuda.amp.GradScaler()

    start_epoch = 0
    if args.resume:
        ck = torch.load(args.resume, map_location=device)
        model.module.load_state_dict(ck["model"])
        optimizer.load_state_dict(ck["optimizer"])
        scheduler.load_state_dict(ck["scheduler"])
        scaler.load_state_dict(ck["scaler"])
        start_epoch = ck["epoch"] + 1

    if main_proc:
        os.makedirs(args.out, exist_ok=True)
    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for i, (x, y) in enumerate(loader):
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.float16):
                logits = model(x, y)
            loss = F.cross_entropy(logits.float(), y)
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            nn.utils.clip_grad_norm_(model.parameters(), 5.0)
            scaler.step(optimizer)
            scaler.update()
            scheduler.step()
            if main_proc and i % 100 == 0:
                print(f"ep{epoch} {i}/{len(loader)} loss {loss.item():.4f} norm_mean {model.module.head.batch_mean.item():.2f} "
                      f"{time.time() - t0:.0f}s", flush=True)

        # closed-set identification accuracy on held-out images of the training identities
        model.eval()
        hits = torch.zeros(2, device=device)
        with torch.no_grad():
            w = F.normalize(model.module.head.kernel, dim=0)
            for x, y in val_loader:
                x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
                e = F.normalize(model.module.backbone(x))
                hits[0] += ((e @ w).argmax(1) == y).sum()
                hits[1] += y.numel()
        dist.all_reduce(hits)
        if main_proc:
            print(f"epoch {epoch}: val top-1 {(hits[0] / hits[1]).item():.4f}", flush=True)
            torch.save({"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                        "scheduler": scheduler.state_dict(), "scaler": scaler.state_dict(), "epoch": epoch},
                       os.path.join(args.out, "last.pth"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    args = parse_args()
    mp.spawn(worker, args=(args.gpus, args), nprocs=args.gpus, join=True)
