"""BYOL with the EMA target network kept outside DDP.

Only the online network (encoder + projector + predictor) is wrapped in DDP; the target is a
plain module updated in place from ``online.module`` after every optimizer step.  Both views go
through the online network in a single forward.

    torchrun --nnodes=4 --nproc_per_node=8 --rdzv_backend=c10d --rdzv_endpoint=$HEAD:29500 \
        18_byol_target_outside_ddp.py --data /shared/imagenet/train --out /shared/runs/byol_4k
"""
import argparse
import copy
import math
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchvision
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter
from torchvision import transforms as T


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--epochs", type=int, default=300)
    p.add_argument("--warmup-epochs", type=int, default=10)
    p.add_argument("--batch-size", type=int, default=128, help="per GPU")
    p.add_argument("--base-lr", type=float, default=0.2, help="per 256 images")
    p.add_argument("--wd", type=float, default=1.5e-6)
    p.add_argument("--tau-base", type=float, default=0.99)
    p.add_argument("--workers", type=int, default=12)
    return p.parse_args()


def byol_aug(blur_p, solarize_p):
    return T.Compose([
        T.RandomResizedCrop(224, interpolation=T.InterpolationMode.BICUBIC),
        T.RandomHorizontalFlip(),
        T.RandomApply([T.ColorJitter(0.4, 0.4, 0.2, 0.1)], p=0.8),
        T.RandomGrayscale(p=0.2),
        T.RandomApply([T.GaussianBlur(23, sigma=(0.1, 2.0))], p=blur_p),
        T.RandomSolarize(128, p=solarize_p),
        T.ToTensor(),
        T.Normalize((0.485, 0.456, 0.406), (0.229, 0.224, 0.225)),
    ])


class Views:
    def __init__(self):
        self.a, self.b = byol_aug(1.0, 0.0), byol_aug(0.1, 0.2)

    def __call__(self, img):
        return self.a(img), self.b(img)


def mlp(in_dim, hidden=4096, out=256):
    return nn.Sequential(nn.Linear(in_dim, hidden), nn.BatchNorm1d(hidden), nn.ReLU(inplace=True),
                         nn.Linear(hidden, out))


class Online(nn.Module):
    def __init__(self):
        super().__init__()
        resnet = torchvision.models.resnet50()
        resnet.fc = nn.Identity()
        self.encoder = nn.Sequential(resnet, mlp(2048))
        self.predictor = mlp(256)

    def forward(self, x):
        return self.predictor(self.encoder(x))


class LARS(torch.optim.Optimizer):
    def __init__(self, params, lr, momentum=0.9, weight_decay=0.0, eta=0.001):
        super().__init__(params, dict(lr=lr, momentum=momentum, weight_decay=weight_decay, eta=eta))

    @torch.no_grad()
    def step(self):
        for g in self.param_groups:
            for p in g["params"]:
                if p.grad is None:
                    continue
                d = p.grad
                if g.get("adapt", True):
                    d = d.add(p, alpha=g["weight_decay"])
                    w, u = p.norm(), d.norm()
                    d = d * torch.where((w > 0) & (u > 0), g["eta"] * w / u, torch.ones_like(w))
                mu = self.state[p].setdefault("mu", torch.zeros_like(p))
                mu.mul_(g["momentum"]).add_(d)
                p.add_(mu, alpha=-g["lr"])


def byol_loss(p, z):
    return (2 - 2 * F.cosine_similarity(p, z.detach(), dim=-1)).mean()


@torch.no_grad()
def ema_update(target, online_encoder, tau):
    t_params = list(target.parameters())
    o_params = list(online_encoder.parameters())
    torch._foreach_mul_(t_params, tau)
    torch._foreach_add_(t_params, o_params, alpha=1.0 - tau)


def main():
    args = parse()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.backends.cudnn.benchmark = True

    ds = torchvision.datasets.ImageFolder(args.data, transform=Views())
    sampler = DistributedSampler(ds, shuffle=True, drop_last=True)
    loader = DataLoader(ds, batch_size=args.batch_size, sampler=sampler, num_workers=args.workers,
                        pin_memory=True, drop_last=True, persistent_workers=True)

    online = nn.SyncBatchNorm.convert_sync_batchnorm(Online()).to(device)
    # running stats are already global through SyncBN, no need to re-broadcast them every step
    online = DDP(online, device_ids=[local_rank], broadcast_buffers=False)
    # copied after DDP has broadcast rank 0's weights, so every rank starts from the same target
    target = copy.deepcopy(online.module.encoder).requires_grad_(False)

    global_bs = args.batch_size * world
    peak_lr = args.base_lr * global_bs / 256
    adapt, no_adapt = [], []
    for n, p in online.named_parameters():
        (no_adapt if p.ndim == 1 else adapt).append(p)
    optimizer = LARS([{"params": adapt, "weight_decay": args.wd},
                      {"params": no_adapt, "weight_decay": 0.0, "adapt": False}], lr=peak_lr)

    steps_per_epoch = len(loader)
    total = args.epochs * steps_per_epoch
    warm = args.warmup_epochs * steps_per_epoch

    ckpt_path = os.path.join(args.out, "checkpoint.pth")
    start_epoch = 0
    if os.path.exists(ckpt_path):
        ck = torch.load(ckpt_path, map_location="cpu")
        online.module.load_state_dict(ck["online"])
        target.load_state_dict(ck["target"])
        optimizer.load_state_dict(ck["optimizer"])
        start_epoch = ck["epoch"]

    writer = None
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        writer = SummaryWriter(os.path.join(args.out, "tb"))
        print(f"{world} GPUs, global batch {global_bs}, peak lr {peak_lr:.3f}", flush=True)

    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)
        online.train()
        target.train()
        tic = time.time()
        for i, ((v1, v2), _) in enumerate(loader):
            step = epoch * steps_per_epoch + i
            lr = peak_lr * step / warm if step < warm else \
                peak_lr * 0.5 * (1 + math.cos(math.pi * (step - warm) / (total - warm)))
            for g in optimizer.param_groups:
                g["lr"] = lr
            tau = 1 - (1 - args.tau_base) * (math.cos(math.pi * step / total) + 1) / 2

            x = torch.cat([v1, v2]).to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                p1, p2 = online(x).float().chunk(2)
                with torch.no_grad():
                    z1, z2 = target(x).float().chunk(2)
            loss = byol_loss(p1, z2) + byol_loss(p2, z1)

            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            ema_update(target, online.module.encoder, tau)

            if i % 100 == 0:
                l = loss.detach()
                dist.all_reduce(l, op=dist.ReduceOp.AVG)
                if rank == 0:
                    writer.add_scalar("loss", l.item(), step)
                    writer.add_scalar("lr", lr, step)
                    writer.add_scalar("tau", tau, step)
                    print(f"ep {epoch} {i}/{steps_per_epoch} loss {l.item():.4f} lr {lr:.3f} tau {tau:.4f} "
                          f"{(time.time() - tic) / (i + 1):.2f}s/it", flush=True)

        if rank == 0:
            ck = {"online": online.module.state_dict(), "target": target.state_dict(),
                  "optimizer": optimizer.state_dict(), "epoch": epoch + 1}
            torch.save(ck, ckpt_path + ".tmp")
            os.replace(ckpt_path + ".tmp", ckpt_path)
            torch.save(target[0].state_dict(), os.path.join(args.out, "target_backbone.pth"))
        dist.barrier()

    if writer is not None:
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
