"""SimCLR pretraining of a ResNet-50 on ImageNet-100 (or any ImageFolder) with NT-Xent over all GPUs.

torchrun --nproc_per_node=8 09_simclr_resnet.py --data /datasets/imagenet100/train --epochs 200
"""
import argparse
import math
import os
import time

import torch
import torch.distributed as dist
import torch.distributed.nn
import torch.nn as nn
import torch.nn.functional as F
import torchvision
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from torchvision import transforms

try:
    import wandb
except ImportError:
    wandb = None


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
        transforms.Normalize((0.485, 0.456, 0.406), (0.229, 0.224, 0.225)),
    ])


class SimCLR(nn.Module):
    def __init__(self, proj_dim=128, hidden=2048):
        super().__init__()
        backbone = torchvision.models.resnet50(weights=None)
        feat_dim = backbone.fc.in_features
        backbone.fc = nn.Identity()
        self.backbone = backbone
        self.projector = nn.Sequential(
            nn.Linear(feat_dim, hidden, bias=False), nn.BatchNorm1d(hidden), nn.ReLU(inplace=True),
            nn.Linear(hidden, hidden, bias=False), nn.BatchNorm1d(hidden), nn.ReLU(inplace=True),
            nn.Linear(hidden, proj_dim, bias=False), nn.BatchNorm1d(proj_dim, affine=False))

    def forward(self, x1, x2):
        z1 = self.projector(self.backbone(x1))
        z2 = self.projector(self.backbone(x2))
        return z1, z2


def nt_xent(z1, z2, temperature):
    """NT-Xent where negatives come from every GPU's batch."""
    z1 = F.normalize(z1, dim=1)
    z2 = F.normalize(z2, dim=1)
    # differentiable all_gather
    z1_all = torch.cat(torch.distributed.nn.all_gather(z1), dim=0)
    z2_all = torch.cat(torch.distributed.nn.all_gather(z2), dim=0)
    n = z1.size(0)
    rank = dist.get_rank()
    labels = torch.arange(n, device=z1.device) + rank * n
    total = z1_all.size(0)
    mask = F.one_hot(labels, total).bool()  # positions of self-similarity in z1 @ z1_all.T

    logits_aa = (z1 @ z1_all.t()) / temperature
    logits_aa = logits_aa.masked_fill(mask, -1e9)
    logits_bb = (z2 @ z2_all.t()) / temperature
    logits_bb = logits_bb.masked_fill(mask, -1e9)
    logits_ab = (z1 @ z2_all.t()) / temperature
    logits_ba = (z2 @ z1_all.t()) / temperature

    loss_a = F.cross_entropy(torch.cat([logits_ab, logits_aa], dim=1), labels)
    loss_b = F.cross_entropy(torch.cat([logits_ba, logits_bb], dim=1), labels)
    return 0.5 * (loss_a + loss_b)


def lr_at(step, total, warmup, peak):
    if step < warmup:
        return peak * step / warmup
    return peak * 0.5 * (1.0 + math.cos(math.pi * (step - warmup) / (total - warmup)))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--data", required=True)
    parser.add_argument("--epochs", type=int, default=200)
    parser.add_argument("--batch-size", type=int, default=128, help="per GPU")
    parser.add_argument("--lr", type=float, default=0.3, help="lr per 256 images (lr = lr * B / 256)")
    parser.add_argument("--wd", type=float, default=1e-6)
    parser.add_argument("--temperature", type=float, default=0.1)
    parser.add_argument("--warmup-epochs", type=int, default=10)
    parser.add_argument("--workers", type=int, default=10)
    parser.add_argument("--ckpt-dir", default="checkpoints/simclr_r50")
    parser.add_argument("--wandb", action="store_true")
    args = parser.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.backends.cudnn.benchmark = True

    dataset = torchvision.datasets.ImageFolder(args.data, TwoCrops(simclr_transform()))
    sampler = DistributedSampler(dataset, shuffle=True, drop_last=True)
    loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler, num_workers=args.workers,
                        pin_memory=True, drop_last=True, persistent_workers=True)

    model = SimCLR()
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).to(device)
    model = DDP(model, device_ids=[local_rank])

    global_bs = args.batch_size * world
    peak_lr = args.lr * global_bs / 256
    # plain SGD w/ momentum + cosine (LARS left out); no weight decay on BN / bias
    decay = [p for n, p in model.named_parameters() if p.ndim > 1]
    no_decay = [p for n, p in model.named_parameters() if p.ndim <= 1]
    optimizer = torch.optim.SGD([{"params": decay, "weight_decay": args.wd},
                                 {"params": no_decay, "weight_decay": 0.0}], lr=peak_lr, momentum=0.9)

    start_epoch = 0
    ckpt_path = os.path.join(args.ckpt_dir, "last.pth")
    if os.path.exists(ckpt_path):
        ckpt = torch.load(ckpt_path, map_location=device)
        model.module.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        start_epoch = ckpt["epoch"] + 1
        if rank == 0:
            print(f"resumed from epoch {ckpt['epoch']}")

    if rank == 0 and args.wandb and wandb is not None:
        wandb.init(project="simclr", config=vars(args))

    steps_per_epoch = len(loader)
    total_steps = args.epochs * steps_per_epoch
    warmup_steps = args.warmup_epochs * steps_per_epoch

    for epoch in range(start_epoch, args.epochs):
        model.train()
        t0 = time.time()
        epoch_loss = torch.zeros(1, device=device)
        for i, ((x1, x2), _) in enumerate(loader):
            step = epoch * steps_per_epoch + i
            lr = lr_at(step, total_steps, warmup_steps, peak_lr)
            for g in optimizer.param_groups:
                g["lr"] = lr
            x1 = x1.to(device, non_blocking=True)
            x2 = x2.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                z1, z2 = model(x1, x2)
            loss = nt_xent(z1.float(), z2.float(), args.temperature)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            epoch_loss += loss.detach()

            if i % 50 == 0 and rank == 0:
                print(f"ep {epoch} [{i}/{steps_per_epoch}] loss {loss.item():.4f} lr {lr:.4f}", flush=True)

        dist.all_reduce(epoch_loss, op=dist.ReduceOp.AVG)
        mean_loss = epoch_loss.item() / steps_per_epoch
        if rank == 0:
            print(f"epoch {epoch} mean loss {mean_loss:.4f} time {time.time() - t0:.0f}s", flush=True)
            if args.wandb and wandb is not None:
                wandb.log({"loss": mean_loss, "lr": lr, "epoch": epoch})
            os.makedirs(args.ckpt_dir, exist_ok=True)
            state = {"model": model.module.state_dict(), "optimizer": optimizer.state_dict(), "epoch": epoch}
            torch.save(state, ckpt_path + ".tmp")
            os.replace(ckpt_path + ".tmp", ckpt_path)
            if (epoch + 1) % 50 == 0:
                torch.save(model.module.backbone.state_dict(),
                           os.path.join(args.ckpt_dir, f"resnet50_ep{epoch + 1}.pth"))
        dist.barrier()

    if rank == 0 and args.wandb and wandb is not None:
        wandb.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
