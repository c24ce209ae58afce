"""SimCLR pre-training on ImageNet-100 with DDP.

The NT-Xent loss uses negatives from all GPUs: embeddings are gathered with
torch.distributed.nn.functional.all_gather, which is differentiable, so each
rank's embeddings also receive the gradient of the other ranks' losses.

torchrun --nproc_per_node=8 10_simclr_ddp_allgather.py --data /datasets/imagenet100 --accum 2
"""
import argparse
import math
import os
import time

import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_fn
import torch.nn as nn
import torch.nn.functional as F
import torchvision
import torchvision.transforms as T
import wandb
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--out", default="checkpoints/simclr_in100")
    p.add_argument("--arch", default="resnet50")
    p.add_argument("--epochs", type=int, default=400)
    p.add_argument("--batch-size", type=int, default=128, help="per GPU, per micro-step")
    p.add_argument("--accum", type=int, default=1)
    p.add_argument("--base-lr", type=float, default=0.3, help="scaled by global batch / 256")
    p.add_argument("--wd", type=float, default=1e-6)
    p.add_argument("--temperature", type=float, default=0.2)
    p.add_argument("--proj-dim", type=int, default=128)
    p.add_argument("--workers", type=int, default=10)
    p.add_argument("--resume", action="store_true")
    p.add_argument("--wandb-project", default="simclr")
    return p.parse_args()


class TwoCrops:
    def __init__(self, tf):
        self.tf = tf

    def __call__(self, img):
        return self.tf(img), self.tf(img)


def simclr_transform():
    jitter = T.ColorJitter(0.4, 0.4, 0.4, 0.1)
    return T.Compose([
        T.RandomResizedCrop(224, scale=(0.08, 1.0)),
        T.RandomHorizontalFlip(),
        T.RandomApply([jitter], p=0.8),
        T.RandomGrayscale(p=0.2),
        T.RandomApply([T.GaussianBlur(23, sigma=(0.1, 2.0))], p=0.5),
        T.ToTensor(),
        T.Normalize((0.485, 0.456, 0.406), (0.229, 0.224, 0.225)),
    ])


class SimCLR(nn.Module):
    def __init__(self, arch, proj_dim):
        super().__init__()
        self.backbone = getattr(torchvision.models, arch)(weights=None)
        feat = self.backbone.fc.in_features
        self.backbone.fc = nn.Identity()
        self.projector = nn.Sequential(
            nn.Linear(feat, 2048, bias=False), nn.BatchNorm1d(2048), nn.ReLU(inplace=True),
            nn.Linear(2048, proj_dim, bias=False), nn.BatchNorm1d(proj_dim, affine=False))

    def forward(self, x):
        return self.projector(self.backbone(x))


def nt_xent(z1, z2, temperature):
    """Local queries against the negatives of every rank."""
    z1, z2 = F.normalize(z1, dim=1), F.normalize(z2, dim=1)
    rank, b = dist.get_rank(), z1.size(0)
    all1 = torch.cat(dist_fn.all_gather(z1), dim=0)
    all2 = torch.cat(dist_fn.all_gather(z2), dim=0)
    keys = torch.cat([all1, all2], dim=0)                     # 2N x d
    n = all1.size(0)
    labels = torch.arange(b, device=z1.device) + rank * b
    logits1 = z1 @ keys.t() / temperature                     # b x 2N
    logits2 = z2 @ keys.t() / temperature
    self_mask1 = F.one_hot(labels, 2 * n).bool()
    self_mask2 = F.one_hot(labels + n, 2 * n).bool()
    logits1 = logits1.masked_fill(self_mask1, float("-inf"))
    logits2 = logits2.masked_fill(self_mask2, float("-inf"))
    return 0.5 * (F.cross_entropy(logits1, labels + n) + F.cross_entropy(logits2, labels))


def cosine(step, total, warmup, peak):
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

    dataset = torchvision.datasets.ImageFolder(os.path.join(args.data, "train"), TwoCrops(simclr_transform()))
    sampler = DistributedSampler(dataset, shuffle=True, drop_last=True)
    loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler, num_workers=args.workers,
                        pin_memory=True, drop_last=True, persistent_workers=True)

    model = SimCLR(args.arch, args.proj_dim)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).to(device)
    model = DDP(model, device_ids=[local_rank], output_device=local_rank)

    global_batch = args.batch_size * args.accum * world
    peak_lr = args.base_lr * global_batch / 256
    optimizer = torch.optim.SGD(model.parameters(), lr=peak_lr, momentum=0.9, weight_decay=args.wd)
    scaler = torch.cuda.amp.GradScaler()

    start_epoch = 0
    ckpt_path = os.path.join(args.out, "last.pth")
    if args.resume and os.path.isfile(ckpt_path):
        ckpt = torch.load(ckpt_path, map_location=device)
        model.module.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        scaler.load_state_dict(ckpt["scaler"])
        start_epoch = ckpt["epoch"] + 1

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        wandb.init(project=args.wandb_project, config={**vars(args), "global_batch": global_batch},
                   resume="allow", id=os.environ.get("WANDB_RUN_ID"))

    opt_steps_per_epoch = len(loader) // args.accum
    total = args.epochs * opt_steps_per_epoch
    warmup = 10 * opt_steps_per_epoch
    step = start_epoch * opt_steps_per_epoch
    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        optimizer.zero_grad(set_to_none=True)
        t0 = time.time()
        for i, ((x1, x2), _) in enumerate(loader):
            x1 = x1.to(device, non_blocking=True)
            x2 = x2.to(device, non_blocking=True)
            last_micro = (i + 1) % args.accum == 0
            # one forward on both views keeps SyncBN and DDP to one call per micro-step
            with torch.autocast("cuda", dtype=torch.float16):
                z = model(torch.cat([x1, x2], dim=0))
            z1, z2 = z.float().chunk(2)
            loss = nt_xent(z1, z2, args.temperature) / args.accum
            if last_micro:
                scaler.scale(loss).backward()
            else:
                with model.no_sync():
                    scaler.scale(loss).backward()
            if not last_micro:
                continue

            for g in optimizer.param_groups:
                g["lr"] = cosine(step, total, warmup, peak_lr)
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad(set_to_none=True)
            step += 1

            if step % 50 == 0:
                stat = loss.detach() * args.accum
                dist.all_reduce(stat, op=dist.ReduceOp.AVG)
                if rank == 0:
                    wandb.log({"loss": stat.item(), "lr": optimizer.param_groups[0]["lr"],
                               "epoch": epoch}, step=step)

        if rank == 0:
            print(f"epoch {epoch} done in {time.time() - t0:.0f}s", flush=True)
            state = {"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                     "scaler": scaler.state_dict(), "epoch": epoch, "args": vars(args)}
            torch.save(state, ckpt_path + ".tmp")
            os.replace(ckpt_path + ".tmp", ckpt_path)
            if (epoch + 1) % 50 == 0:
                torch.save(model.module.backbone.state_dict(), os.path.join(args.out, f"backbone_ep{epoch + 1}.pth"))
        dist.barrier()

    if rank == 0:
        wandb.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
