"""SimCLR pretraining of ResNet-50 on ImageNet, LARS optimizer, NT-Xent over the global batch.

torchrun --nnodes=4 --nproc_per_node=8 --rdzv_backend=c10d --rdzv_endpoint=$HEAD:29400 \
    04_simclr_resnet50.py --data /datasets/imagenet/train --out /shared/ckpt/simclr_r50 --batch-size 4096
"""
import argparse
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
from torchvision import transforms


def get_parser():
    p = argparse.ArgumentParser("simclr")
    p.add_argument("--data", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--epochs", type=int, default=100)
    p.add_argument("--batch-size", type=int, default=4096, help="global batch size")
    p.add_argument("--base-lr", type=float, default=0.3, help="lr = base_lr * batch / 256")
    p.add_argument("--wd", type=float, default=1e-6)
    p.add_argument("--temperature", type=float, default=0.1)
    p.add_argument("--warmup-epochs", type=int, default=10)
    p.add_argument("--proj-dim", type=int, default=128)
    p.add_argument("--workers", type=int, default=10)
    p.add_argument("--save-every", type=int, default=10)
    return p


class GatherLayer(torch.autograd.Function):
    """All-gather that back-propagates to every rank's input."""

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


class TwoCrops:
    def __init__(self, tf):
        self.tf = tf

    def __call__(self, x):
        return self.tf(x), self.tf(x)


def simclr_augment():
    color = transforms.ColorJitter(0.8, 0.8, 0.8, 0.2)
    return transforms.Compose([
        transforms.RandomResizedCrop(224, scale=(0.08, 1.0)),
        transforms.RandomHorizontalFlip(),
        transforms.RandomApply([color], p=0.8),
        transforms.RandomGrayscale(p=0.2),
        transforms.RandomApply([transforms.GaussianBlur(23, sigma=(0.1, 2.0))], p=0.5),
        transforms.ToTensor(),
        transforms.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225]),
    ])


class SimCLR(nn.Module):
    def __init__(self, proj_dim):
        super().__init__()
        self.encoder = torchvision.models.resnet50(zero_init_residual=True)
        self.encoder.fc = nn.Identity()
        self.projector = nn.Sequential(
            nn.Linear(2048, 2048, bias=False), nn.BatchNorm1d(2048), nn.ReLU(inplace=True),
            nn.Linear(2048, 2048, bias=False), nn.BatchNorm1d(2048), nn.ReLU(inplace=True),
            nn.Linear(2048, proj_dim, bias=False), nn.BatchNorm1d(proj_dim, affine=False),
        )

    def forward(self, x):
        return self.projector(self.encoder(x))


def nt_xent(z1, z2, temperature):
    z1, z2 = F.normalize(z1, dim=1), F.normalize(z2, dim=1)
    z1 = torch.cat(GatherLayer.apply(z1), dim=0)
    z2 = torch.cat(GatherLayer.apply(z2), dim=0)
    z = torch.cat([z1, z2], dim=0)
    n = z1.shape[0]
    sim = z @ z.t() / temperature
    sim.fill_diagonal_(float("-inf"))
    targets = torch.cat([torch.arange(n, 2 * n), torch.arange(0, n)]).to(z.device)
    return F.cross_entropy(sim, targets)


class LARS(torch.optim.Optimizer):
    def __init__(self, params, lr, weight_decay=0, momentum=0.9, eta=0.001):
        super().__init__(params, dict(lr=lr, weight_decay=weight_decay, momentum=momentum, eta=eta))

    @torch.no_grad()
    def step(self):
        for g in self.param_groups:
            for p in g["params"]:
                if p.grad is None:
                    continue
                dp = p.grad
                if p.ndim > 1:  # no wd / lars adaptation for biases and bn
                    dp = dp.add(p, alpha=g["weight_decay"])
                    param_norm, update_norm = torch.norm(p), torch.norm(dp)
                    q = torch.where(param_norm > 0.0,
                                    torch.where(update_norm > 0, g["eta"] * param_norm / update_norm, 1.0), 1.0)
                    dp = dp.mul(q)
                state = self.state[p]
                if "mu" not in state:
                    state["mu"] = torch.zeros_like(p)
                mu = state["mu"]
                mu.mul_(g["momentum"]).add_(dp)
                p.add_(mu, alpha=-g["lr"])


def adjust_lr(optimizer, step, total, warmup, peak):
    if step < warmup:
        lr = peak * step / warmup
    else:
        lr = peak * 0.5 * (1 + math.cos(math.pi * (step - warmup) / (total - warmup)))
    for g in optimizer.param_groups:
        g["lr"] = lr
    return lr


def main():
    args = get_parser().parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda")

    assert args.batch_size % world == 0
    per_gpu = args.batch_size // world

    dataset = torchvision.datasets.ImageFolder(args.data, TwoCrops(simclr_augment()))
    sampler = DistributedSampler(dataset, shuffle=True, drop_last=True)
    loader = DataLoader(dataset, batch_size=per_gpu, sampler=sampler, num_workers=args.workers,
                        pin_memory=True, drop_last=True, persistent_workers=True)

    model = SimCLR(args.proj_dim).to(device)
    model = DDP(model, device_ids=[local_rank])
    peak_lr = args.base_lr * args.batch_size / 256
    optimizer = LARS(model.parameters(), lr=peak_lr, weight_decay=args.wd)
    scaler = torch.cuda.amp.GradScaler()

    start_epoch = 0
    ckpt_path = os.path.join(args.out, "checkpoint.pth")
    if os.path.exists(ckpt_path):
        ckpt = torch.load(ckpt_path, map_location=device)
        model.module.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        scaler.load_state_dict(ckpt["scaler"])
        start_epoch = ckpt["epoch"]
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)

    steps_per_epoch = len(loader)
    total_steps = args.epochs * steps_per_epoch
    warmup_steps = args.warmup_epochs * steps_per_epoch
    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for i, ((x1, x2), _) in enumerate(loader):
            step = epoch * steps_per_epoch + i
            lr = adjust_lr(optimizer, step, total_steps, warmup_steps, peak_lr)
            x = torch.cat([x1, x2], dim=0).to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.float16):
                z = model(x)
            z1, z2 = z.float().chunk(2)
            loss = nt_xent(z1, z2, args.temperature)
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            if i % 50 == 0:
                avg = loss.detach()
                dist.all_reduce(avg, op=dist.ReduceOp.AVG)
                if rank == 0:
                    print(f"epoch {epoch} [{i}/{steps_per_epoch}] loss {avg.item():.4f} lr {lr:.4f} "
                          f"{(time.time() - t0) / (i + 1):.3f}s/it", flush=True)
        if rank == 0 and ((epoch + 1) % args.save_every == 0 or epoch + 1 == args.epochs):
            torch.save({"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                        "scaler": scaler.state_dict(), "epoch": epoch + 1}, ckpt_path + ".tmp")
            os.replace(ckpt_path + ".tmp", ckpt_path)
            torch.save(model.module.encoder.state_dict(), os.path.join(args.out, "resnet50_encoder.pth"))

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
