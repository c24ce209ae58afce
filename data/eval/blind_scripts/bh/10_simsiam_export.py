"""SimSiam pre-training on ImageNet-100 with torchrun; exports the ResNet backbone
for downstream linear probing / detection fine-tuning at the end of training.

    torchrun --nproc_per_node=4 10_simsiam_export.py --data /datasets/imagenet100 --out runs/simsiam
"""
import argparse
import math
import os
import random
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchvision
import torchvision.transforms as T
from PIL import ImageFilter
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler


def get_args():
    parser = argparse.ArgumentParser(description="SimSiam")
    parser.add_argument("--data", required=True)
    parser.add_argument("--out", default="runs/simsiam")
    parser.add_argument("--arch", default="resnet50")
    parser.add_argument("--epochs", type=int, default=200)
    parser.add_argument("--batch-size", type=int, default=64, help="per-GPU batch size")
    parser.add_argument("--lr", type=float, default=0.05, help="base lr, scaled by global batch / 256")
    parser.add_argument("--wd", type=float, default=1e-4)
    parser.add_argument("--dim", type=int, default=2048)
    parser.add_argument("--pred-dim", type=int, default=512)
    parser.add_argument("--fix-pred-lr", action="store_true", help="keep the predictor lr constant")
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--print-freq", type=int, default=50)
    parser.add_argument("--save-every", type=int, default=10)
    return parser.parse_args()


class GaussianBlur:
    def __init__(self, sigma=(0.1, 2.0)):
        self.sigma = sigma

    def __call__(self, x):
        return x.filter(ImageFilter.GaussianBlur(radius=random.uniform(*self.sigma)))


class TwoCrops:
    def __init__(self, t):
        self.t = t

    def __call__(self, x):
        return [self.t(x), self.t(x)]


class SimSiam(nn.Module):
    def __init__(self, base_encoder, dim=2048, pred_dim=512):
        super().__init__()
        self.encoder = base_encoder(num_classes=dim, zero_init_residual=True)
        prev_dim = self.encoder.fc.weight.shape[1]
        self.encoder.fc = nn.Sequential(
            nn.Linear(prev_dim, prev_dim, bias=False), nn.BatchNorm1d(prev_dim), nn.ReLU(inplace=True),
            nn.Linear(prev_dim, prev_dim, bias=False), nn.BatchNorm1d(prev_dim), nn.ReLU(inplace=True),
            self.encoder.fc, nn.BatchNorm1d(dim, affine=False))
        self.encoder.fc[6].bias.requires_grad = False  # no bias, BN follows
        self.predictor = nn.Sequential(
            nn.Linear(dim, pred_dim, bias=False), nn.BatchNorm1d(pred_dim), nn.ReLU(inplace=True),
            nn.Linear(pred_dim, dim))

    def forward(self, x1, x2):
        z1, z2 = self.encoder(x1), self.encoder(x2)
        p1, p2 = self.predictor(z1), self.predictor(z2)
        return p1, p2, z1.detach(), z2.detach()


def adjust_learning_rate(optimizer, init_lr, epoch, epochs):
    cur_lr = init_lr * 0.5 * (1.0 + math.cos(math.pi * epoch / epochs))
    for group in optimizer.param_groups:
        group["lr"] = init_lr if group.get("fix_lr", False) else cur_lr


def save_checkpoint(model, optimizer, epoch, path):
    torch.save({"epoch": epoch, "state_dict": model.state_dict(), "optimizer": optimizer.state_dict()}, path)


def export_backbone(ckpt_path, out_path, arch):
    """Strip the projector and save plain torchvision ResNet weights (fc left randomly initialised)."""
    sd = torch.load(ckpt_path, map_location="cpu")["state_dict"]
    backbone_sd = {k[len("encoder."):]: v for k, v in sd.items()
                   if k.startswith("encoder.") and not k.startswith("encoder.fc")}
    net = torchvision.models.__dict__[arch]()
    msg = net.load_state_dict(backbone_sd, strict=False)
    print(f"export: missing keys {msg.missing_keys[:4]}{'...' if len(msg.missing_keys) > 4 else ''}")
    torch.save(net.state_dict(), out_path)


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)

    normalize = T.Normalize(mean=[0.485, 0.456, 0.406], std=[0.229, 0.224, 0.225])
    aug = T.Compose([
        T.RandomResizedCrop(224, scale=(0.2, 1.0)),
        T.RandomApply([T.ColorJitter(0.4, 0.4, 0.4, 0.1)], p=0.8),
        T.RandomGrayscale(p=0.2),
        T.RandomApply([GaussianBlur([0.1, 2.0])], p=0.5),
        T.RandomHorizontalFlip(),
        T.ToTensor(),
        normalize,
    ])
    train_set = torchvision.datasets.ImageFolder(os.path.join(args.data, "train"), TwoCrops(aug))
    sampler = DistributedSampler(train_set, shuffle=True)
    loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler, num_workers=args.workers,
                        pin_memory=True, drop_last=True)

    model = SimSiam(torchvision.models.__dict__[args.arch], args.dim, args.pred_dim)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).cuda()
    init_lr = args.lr * args.batch_size * world_size / 256

    if args.fix_pred_lr:
        params = [{"params": model.encoder.parameters(), "fix_lr": False},
                  {"params": model.predictor.parameters(), "fix_lr": True}]
    else:
        params = model.parameters()
    model = DDP(model, device_ids=[local_rank])
    criterion = nn.CosineSimilarity(dim=1).cuda()
    optimizer = torch.optim.SGD(params, init_lr, momentum=0.9, weight_decay=args.wd)

    ckpt_path = os.path.join(args.out, "checkpoint.pth.tar")
    start_epoch = 0
    if os.path.isfile(ckpt_path):
        ckpt = torch.load(ckpt_path, map_location="cpu")
        model.load_state_dict(ckpt["state_dict"])
        optimizer.load_state_dict(ckpt["optimizer"])
        start_epoch = ckpt["epoch"]
        if rank == 0:
            print(f"resuming from epoch {start_epoch}")

    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)
        adjust_learning_rate(optimizer, init_lr, epoch, args.epochs)
        model.train()
        end = time.time()
        for i, (images, _) in enumerate(loader):
            x1 = images[0].cuda(non_blocking=True)
            x2 = images[1].cuda(non_blocking=True)
            p1, p2, z1, z2 = model(x1, x2)
            loss = -(criterion(p1, z2).mean() + criterion(p2, z1).mean()) * 0.5

            optimizer.zero_grad()
            loss.backward()
            optimizer.step()

            if i % args.print_freq == 0:
                # std of the normalised output: collapse shows up as this going to 0
                with torch.no_grad():
                    out_std = F.normalize(z1, dim=1).std(dim=0).mean()
                    stats = torch.stack([loss.detach(), out_std])
                    dist.all_reduce(stats, op=dist.ReduceOp.AVG)
                if rank == 0:
                    print(f"ep {epoch} [{i}/{len(loader)}] loss {stats[0].item():.4f} "
                          f"z-std {stats[1].item():.4f} ({time.time() - end:.2f}s/it)", flush=True)
            end = time.time()

        if rank == 0:
            save_checkpoint(model, optimizer, epoch + 1, ckpt_path)
            if (epoch + 1) % args.save_every == 0:
                save_checkpoint(model, optimizer, epoch + 1, os.path.join(args.out, f"ep{epoch + 1:04d}.pth.tar"))

    if rank == 0:
        export_backbone(ckpt_path, os.path.join(args.out, f"{args.arch}_simsiam_backbone.pth"), args.arch)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
