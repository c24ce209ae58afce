"""SimCLR pre-training (ResNet-50) with a global NT-Xent loss.

Horovod version used hvd.allgather on the projections; here the gather is
done with torch.distributed.nn.functional.all_gather so gradients flow back to
every rank. Started with torchrun.
"""
import argparse
import math
import os
import time

import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_nn
import torch.nn as nn
import torch.nn.functional as F
import torchvision
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from torchvision import transforms


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data", default="/datasets/imagenet/train")
    p.add_argument("--batch-size", type=int, default=256, help="per GPU")
    p.add_argument("--epochs", type=int, default=100)
    p.add_argument("--base-lr", type=float, default=0.3, help="scaled by global batch / 256")
    p.add_argument("--wd", type=float, default=1e-6)
    p.add_argument("--temperature", type=float, default=0.1)
    p.add_argument("--proj-dim", type=int, default=128)
    p.add_argument("--warmup-epochs", type=int, default=10)
    p.add_argument("--workers", type=int, default=10)
    p.add_argument("--ckpt", default="ckpt/simclr_r50.pt")
    return p.parse_args()


class TwoCrops:
    def __init__(self, tf):
        self.tf = tf

    def __call__(self, x):
        return self.tf(x), self.tf(x)


def simclr_transform(size=224):
    color = transforms.ColorJitter(0.8, 0.8, 0.8, 0.2)
    return transforms.Compose([
        transforms.RandomResizedCrop(size, scale=(0.08, 1.0)),
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
        self.backbone = torchvision.models.resnet50()
        dim = self.backbone.fc.in_features
        self.backbone.fc = nn.Identity()
        self.projector = nn.Sequential(nn.Linear(dim, 2048, bias=False), nn.BatchNorm1d(2048), nn.ReLU(inplace=True),
                                       nn.Linear(2048, proj_dim, bias=False), nn.BatchNorm1d(proj_dim, affine=False))

    def forward(self, x):
        return self.projector(self.backbone(x))


def nt_xent(z1, z2, temperature, rank):
    z1, z2 = F.normalize(z1, dim=1), F.normalize(z2, dim=1)
    # gather all projections from all ranks (differentiable)
    z2_all = torch.cat(dist_nn.all_gather(z2), dim=0)
    z1_all = torch.cat(dist_nn.all_gather(z1), dim=0)
    n = z1.size(0)
    labels = torch.arange(n, device=z1.device) + rank * n
    big_mask = F.one_hot(labels, z1_all.size(0)).bool()
    logits_ab = z1 @ z2_all.t() / temperature
    logits_aa = (z1 @ z1_all.t() / temperature).masked_fill(big_mask, float("-inf"))
    logits_ba = z2 @ z1_all.t() / temperature
    logits_bb = (z2 @ z2_all.t() / temperature).masked_fill(big_mask, float("-inf"))
    loss_a = F.cross_entropy(torch.cat([logits_ab, logits_aa], 1), labels)
    loss_b = F.cross_entropy(torch.cat([logits_ba, logits_bb], 1), labels)
    return (loss_a + loss_b) / 2


def lr_for_step(step, total, warmup, peak):
    if step < warmup:
        return peak * step / warmup
    return peak * 0.5 * (1 + math.cos(math.pi * (step - warmup) / (total - warmup)))


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.backends.cudnn.benchmark = True

    dataset = torchvision.datasets.ImageFolder(args.data, TwoCrops(simclr_transform()))
    sampler = DistributedSampler(dataset, shuffle=True, drop_last=True)
    loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler, num_workers=args.workers,
                        pin_memory=True, drop_last=True, persistent_workers=True, prefetch_factor=4)

    model = nn.SyncBatchNorm.convert_sync_batchnorm(SimCLR(args.proj_dim)).to(device)
    model = DDP(model, device_ids=[local_rank], broadcast_buffers=False)

    peak_lr = args.base_lr * args.batch_size * world / 256
    params_bn_bias = [p for n, p in model.named_parameters() if p.ndim == 1]
    params_other = [p for n, p in model.named_parameters() if p.ndim > 1]
    optimizer = torch.optim.SGD([{"params": params_other, "weight_decay": args.wd},
                                 {"params": params_bn_bias, "weight_decay": 0.0}],
                                lr=peak_lr, momentum=0.9)
    scaler = torch.cuda.amp.GradScaler()

    start_epoch = 0
    if os.path.exists(args.ckpt):
        ckpt = torch.load(args.ckpt, map_location=device)
        model.module.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        scaler.load_state_dict(ckpt["scaler"])
        start_epoch = ckpt["epoch"] + 1
    steps_per_epoch = len(loader)
    total_steps = args.epochs * steps_per_epoch
    warmup_steps = args.warmup_epochs * steps_per_epoch

    if rank == 0:
        print(f"global batch {args.batch_size * world}, peak lr {peak_lr:.3f}, {steps_per_epoch} steps/epoch")
    for epoch in range(start_epoch, args.epochs):
        model.train()
        t0 = time.time()
        loss_sum = torch.zeros((), device=device)
        for i, ((x1, x2), _) in enumerate(loader):
            step = epoch * steps_per_epoch + i
            lr = lr_for_step(step, total_steps, warmup_steps, peak_lr)
            for g in optimizer.param_groups:
                g["lr"] = lr
            x1, x2 = x1.to(device, non_blocking=True), x2.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.float16):
                z1, z2 = model(x1), model(x2)
            loss = nt_xent(z1.float(), z2.float(), args.temperature, rank)
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            loss_sum += loss.detach()
            if rank == 0 and i % 50 == 0:
                print(f"epoch {epoch} [{i}/{steps_per_epoch}] loss {loss.item():.4f} lr {lr:.4f} "
                      f"{(time.time() - t0) / (i + 1):.3f}s/it")
        dist.all_reduce(loss_sum)
        if rank == 0:
            print(f"epoch {epoch} mean loss {loss_sum.item() / (world * steps_per_epoch):.4f}")
            os.makedirs(os.path.dirname(args.ckpt), exist_ok=True)
            torch.save({"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                        "scaler": scaler.state_dict(), "epoch": epoch}, args.ckpt + ".tmp")
            os.replace(args.ckpt + ".tmp", args.ckpt)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
