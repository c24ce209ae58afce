"""SimCLR with a ViT-S/16 encoder from timm, LAMB optimiser, large batch.

    torchrun --nproc_per_node=8 13_simclr_vit_lamb.py --data /datasets/imagenet/train --batch-size 256
"""
import argparse
import logging
import math
import os
import time

import timm
import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_nn
import torch.nn as nn
import torch.nn.functional as F
from timm.optim import Lamb
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from torchvision import datasets, transforms
from torchvision.transforms import InterpolationMode

log = logging.getLogger(__name__)


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--out", default="out/simclr_vits16")
    ap.add_argument("--arch", default="vit_small_patch16_224")
    ap.add_argument("--epochs", type=int, default=300)
    ap.add_argument("--warmup-epochs", type=int, default=40)
    ap.add_argument("--batch-size", type=int, default=256, help="per device")
    ap.add_argument("--blr", type=float, default=1.5e-4, help="base lr, lr = blr * global_batch / 256")
    ap.add_argument("--min-lr", type=float, default=1e-6)
    ap.add_argument("--wd", type=float, default=0.1)
    ap.add_argument("--temperature", type=float, default=0.2)
    ap.add_argument("--proj-hidden", type=int, default=4096)
    ap.add_argument("--proj-out", type=int, default=256)
    ap.add_argument("--drop-path", type=float, default=0.1)
    ap.add_argument("--workers", type=int, default=10)
    ap.add_argument("--resume", default="")
    return ap.parse_args()


class PairAug:
    def __init__(self):
        self.t = transforms.Compose([
            transforms.RandomResizedCrop(224, scale=(0.08, 1.0), interpolation=InterpolationMode.BICUBIC),
            transforms.RandomHorizontalFlip(),
            transforms.RandomApply([transforms.ColorJitter(0.4, 0.4, 0.2, 0.1)], p=0.8),
            transforms.RandomGrayscale(p=0.2),
            transforms.RandomApply([transforms.GaussianBlur(23, (0.1, 2.0))], p=0.5),
            transforms.RandomSolarize(128, p=0.1),
            transforms.ToTensor(),
            transforms.Normalize((0.485, 0.456, 0.406), (0.229, 0.224, 0.225)),
        ])

    def __call__(self, img):
        return self.t(img), self.t(img)


class ViTSimCLR(nn.Module):
    def __init__(self, arch, hidden, out_dim, drop_path):
        super().__init__()
        self.backbone = timm.create_model(arch, pretrained=False, drop_path_rate=drop_path)
        dim = self.backbone.embed_dim
        self.projector = nn.Sequential(
            nn.Linear(dim, hidden, bias=False), nn.BatchNorm1d(hidden), nn.ReLU(inplace=True),
            nn.Linear(hidden, hidden, bias=False), nn.BatchNorm1d(hidden), nn.ReLU(inplace=True),
            nn.Linear(hidden, out_dim, bias=False), nn.BatchNorm1d(out_dim, affine=False))

    def encode(self, x):
        tokens = self.backbone.forward_features(x)
        return tokens[:, 0]  # [CLS]

    def forward(self, x):
        return self.projector(self.encode(x))


def all_gather_grad(x):
    """all_gather with gradients flowing back to every rank's own slice."""
    gathered = dist_nn.all_gather(x)
    return torch.cat(gathered, dim=0)


def info_nce(q, k, temperature):
    q = F.normalize(q.float(), dim=1)
    k = F.normalize(k.float(), dim=1)
    k_all = all_gather_grad(k)
    logits = q @ k_all.t() / temperature
    labels = torch.arange(q.size(0), device=q.device) + dist.get_rank() * q.size(0)
    return F.cross_entropy(logits, labels) * 2 * temperature


def adjust_lr(optimizer, epoch_float, args, peak):
    if epoch_float < args.warmup_epochs:
        lr = peak * epoch_float / args.warmup_epochs
    else:
        t = (epoch_float - args.warmup_epochs) / (args.epochs - args.warmup_epochs)
        lr = args.min_lr + (peak - args.min_lr) * 0.5 * (1.0 + math.cos(math.pi * t))
    for g in optimizer.param_groups:
        g["lr"] = lr
    return lr


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.ERROR,
                        format=f"[%(asctime)s rank{rank}] %(message)s")

    ds = datasets.ImageFolder(args.data, transform=PairAug())
    sampler = DistributedSampler(ds, shuffle=True, drop_last=True)
    loader = DataLoader(ds, batch_size=args.batch_size, sampler=sampler, num_workers=args.workers,
                        pin_memory=True, drop_last=True, persistent_workers=True)

    model = ViTSimCLR(args.arch, args.proj_hidden, args.proj_out, args.drop_path)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).cuda()
    model = DDP(model, device_ids=[local_rank])

    peak_lr = args.blr * args.batch_size * world / 256
    no_wd = {"pos_embed", "cls_token"}
    decay, skip = [], []
    for n, p in model.module.named_parameters():
        (skip if p.ndim == 1 or n.split(".")[-1] in no_wd else decay).append(p)
    optimizer = Lamb([{"params": decay, "weight_decay": args.wd}, {"params": skip, "weight_decay": 0.0}],
                     lr=peak_lr, betas=(0.9, 0.95))
    scaler = torch.cuda.amp.GradScaler()

    start_epoch = 0
    if args.resume:
        ckpt = torch.load(args.resume, map_location="cpu")
        model.module.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        scaler.load_state_dict(ckpt["scaler"])
        start_epoch = ckpt["epoch"] + 1

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
    log.info("global batch %d, peak lr %.2e, %d steps/epoch", args.batch_size * world, peak_lr, len(loader))

    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        tic = time.time()
        for i, ((v1, v2), _) in enumerate(loader):
            lr = adjust_lr(optimizer, epoch + i / len(loader), args, peak_lr)
            v1 = v1.cuda(non_blocking=True)
            v2 = v2.cuda(non_blocking=True)
            with torch.autocast("cuda", dtype=torch.float16):
                z = model(torch.cat([v1, v2]))
            z1, z2 = z.chunk(2)
            loss = info_nce(z1, z2, args.temperature) + info_nce(z2, z1, args.temperature)

            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(optimizer)
            scaler.update()

            if i % 50 == 0:
                rep = torch.stack([loss.detach(), grad_norm.detach().float()])
                dist.all_reduce(rep, op=dist.ReduceOp.AVG)
                log.info("ep %d it %d/%d loss %.4f gnorm %.2f lr %.2e %.2fs/it", epoch, i, len(loader),
                         rep[0].item(), rep[1].item(), lr, (time.time() - tic) / (i + 1))

        if rank == 0:
            torch.save({"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                        "scaler": scaler.state_dict(), "epoch": epoch}, os.path.join(args.out, "checkpoint.pth"))
            if (epoch + 1) % 50 == 0:
                torch.save(model.module.backbone.state_dict(), os.path.join(args.out, f"vit_ep{epoch + 1}.pth"))

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
