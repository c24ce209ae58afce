"""FixMatch + distribution alignment on ImageNet with 10% labels (ResNet-50, SyncBN).

Distribution alignment (ReMixMatch): the pseudo-label distribution on weak views is
rescaled by  p_target / p_model, where p_model is a running mean of the model's
predictions on unlabelled data.  The running mean is computed from the predictions
of all GPUs.

    torchrun --nnodes=2 --nproc_per_node=8 --rdzv_backend=c10d --rdzv_endpoint=$MASTER:29400 \
        17_fixmatch_da_imagenet.py --data /shared/imagenet --split splits/10percent.txt
"""
import argparse
import math
import os
import time
from copy import deepcopy

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchvision
import wandb
from torch.cuda.amp import GradScaler, autocast
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Subset
from torch.utils.data.distributed import DistributedSampler
from torchvision import transforms as T

MEAN, STD = [0.485, 0.456, 0.406], [0.229, 0.224, 0.225]


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data", default="/shared/imagenet")
    p.add_argument("--split", default="splits/10percent.txt", help="file names of the labelled images")
    p.add_argument("--out", default="/shared/exp/fixmatch_da_in10")
    p.add_argument("--batch-size", type=int, default=32, help="labelled images per GPU")
    p.add_argument("--mu", type=int, default=5)
    p.add_argument("--base-lr", type=float, default=0.1, help="lr for a global labelled batch of 256")
    p.add_argument("--wd", type=float, default=1e-4)
    p.add_argument("--epochs", type=int, default=100, help="passes over the unlabelled set")
    p.add_argument("--warmup-epochs", type=int, default=5)
    p.add_argument("--threshold", type=float, default=0.7)
    p.add_argument("--lambda-u", type=float, default=10.0)
    p.add_argument("--da-momentum", type=float, default=0.999)
    p.add_argument("--ema", type=float, default=0.999)
    p.add_argument("--workers", type=int, default=10)
    p.add_argument("--resume", default="")
    p.add_argument("--wandb-project", default="ssl-imagenet")
    return p.parse_args()


class TwoViews:
    def __init__(self):
        norm = [T.ToTensor(), T.Normalize(MEAN, STD)]
        self.weak = T.Compose([T.RandomResizedCrop(224, scale=(0.2, 1.0)), T.RandomHorizontalFlip()] + norm)
        self.strong = T.Compose([T.RandomResizedCrop(224, scale=(0.2, 1.0)), T.RandomHorizontalFlip(),
                                 T.RandAugment(2, 10)] + norm)

    def __call__(self, img):
        return self.weak(img), self.strong(img)


class DistAlign:
    def __init__(self, num_classes, momentum, device):
        self.p_model = torch.full((num_classes,), 1.0 / num_classes, device=device)
        self.p_target = torch.full((num_classes,), 1.0 / num_classes, device=device)
        self.m = momentum

    @torch.no_grad()
    def __call__(self, probs):
        batch_mean = probs.mean(0)
        dist.all_reduce(batch_mean, op=dist.ReduceOp.AVG)
        self.p_model = self.m * self.p_model + (1 - self.m) * batch_mean
        aligned = probs * (self.p_target / self.p_model)
        return aligned / aligned.sum(1, keepdim=True)


def cosine_with_warmup(step, warmup, total):
    if step < warmup:
        return (step + 1) / warmup
    return 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, total - warmup)))


@torch.no_grad()
def evaluate(net, loader, device):
    net.eval()
    s = torch.zeros(3, device=device)
    for x, y in loader:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        with autocast():
            top5 = net(x).topk(5, 1).indices
        s[0] += (top5[:, 0] == y).sum()
        s[1] += (top5 == y[:, None]).any(1).sum()
        s[2] += y.numel()
    dist.all_reduce(s)
    return (100 * s[0] / s[2]).item(), (100 * s[1] / s[2]).item()


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(0)

    global_bs = args.batch_size * world
    lr = args.base_lr * global_bs / 256

    train_dir = os.path.join(args.data, "train")
    lab_tf = T.Compose([T.RandomResizedCrop(224), T.RandomHorizontalFlip(), T.ToTensor(), T.Normalize(MEAN, STD)])
    lab_full = torchvision.datasets.ImageFolder(train_dir, transform=lab_tf)
    with open(args.split) as f:
        wanted = {line.strip() for line in f if line.strip()}
    lab_idx = [i for i, (path, _) in enumerate(lab_full.samples) if os.path.basename(path) in wanted]
    lab_set = Subset(lab_full, lab_idx)
    unl_set = torchvision.datasets.ImageFolder(train_dir, transform=TwoViews())
    val_set = torchvision.datasets.ImageFolder(
        os.path.join(args.data, "val"),
        transform=T.Compose([T.Resize(256), T.CenterCrop(224), T.ToTensor(), T.Normalize(MEAN, STD)]))

    lab_sampler = DistributedSampler(lab_set, shuffle=True, drop_last=True)
    unl_sampler = DistributedSampler(unl_set, shuffle=True, drop_last=True)
    lab_loader = DataLoader(lab_set, args.batch_size, sampler=lab_sampler, num_workers=args.workers // 2,
                            pin_memory=True, drop_last=True, persistent_workers=True)
    unl_loader = DataLoader(unl_set, args.batch_size * args.mu, sampler=unl_sampler, num_workers=args.workers,
                            pin_memory=True, drop_last=True, persistent_workers=True)
    val_loader = DataLoader(Subset(val_set, range(rank, len(val_set), world)), 256,
                            num_workers=args.workers, pin_memory=True)

    net = torchvision.models.resnet50(num_classes=1000)
    net = nn.SyncBatchNorm.convert_sync_batchnorm(net).to(device)
    model = DDP(net, device_ids=[local_rank])
    ema_model = deepcopy(model.module).eval()
    for p in ema_model.parameters():
        p.requires_grad_(False)

    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9, nesterov=True, weight_decay=args.wd)
    steps_per_epoch = len(unl_loader)
    total_steps = args.epochs * steps_per_epoch
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: cosine_with_warmup(s, args.warmup_epochs * steps_per_epoch, total_steps))
    scaler = GradScaler()
    da = DistAlign(1000, args.da_momentum, device)

    start_epoch, best = 0, 0.0
    if args.resume:
        ck = torch.load(args.resume, map_location="cpu")
        model.module.load_state_dict(ck["model"])
        ema_model.load_state_dict(ck["ema"])
        optimizer.load_state_dict(ck["optimizer"])
        scheduler.load_state_dict(ck["scheduler"])
        scaler.load_state_dict(ck["scaler"])
        da.p_model.copy_(ck["p_model"])
        start_epoch, best = ck["epoch"], ck["best"]

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        wandb.init(project=args.wandb_project, config={**vars(args), "lr": lr, "world": world},
                   resume="allow", id=os.environ.get("WANDB_RUN_ID"))

    lab_epoch = start_epoch * steps_per_epoch // max(1, len(lab_loader))
    lab_sampler.set_epoch(lab_epoch)
    lab_iter = iter(lab_loader)
    for epoch in range(start_epoch, args.epochs):
        unl_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for i, ((u_w, u_s), _) in enumerate(unl_loader):
            try:
                x, y = next(lab_iter)
            except StopIteration:
                lab_epoch += 1
                lab_sampler.set_epoch(lab_epoch)
                lab_iter = iter(lab_loader)
                x, y = next(lab_iter)
            n = x.size(0)
            inputs = torch.cat([x, u_w, u_s]).to(device, non_blocking=True)
            y = y.to(device, non_blocking=True)
            with autocast():
                logits = model(inputs)
            logits = logits.float()
            logits_x = logits[:n]
            logits_w, logits_s = logits[n:].chunk(2)
            loss_x = F.cross_entropy(logits_x, y)
            probs = da(torch.softmax(logits_w.detach(), 1))
            conf, pseudo = probs.max(1)
            mask = (conf >= args.threshold).float()
            loss_u = (F.cross_entropy(logits_s, pseudo, reduction="none") * mask).mean()
            loss = loss_x + args.lambda_u * loss_u

            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            scheduler.step()
            with torch.no_grad():
                for e, p in zip(ema_model.parameters(), model.module.parameters()):
                    e.mul_(args.ema).add_(p.detach(), alpha=1 - args.ema)
                for e, b in zip(ema_model.buffers(), model.module.buffers()):
                    e.copy_(b)

            if rank == 0 and i % 50 == 0:
                wandb.log({"loss_x": loss_x.item(), "loss_u": loss_u.item(), "mask": mask.mean().item(),
                           "lr": scheduler.get_last_lr()[0], "epoch": epoch + i / steps_per_epoch})

        top1, top5 = evaluate(ema_model, val_loader, device)
        if rank == 0:
            wandb.log({"val/top1": top1, "val/top5": top5, "epoch": epoch + 1})
            print(f"epoch {epoch}: ema top1 {top1:.2f} top5 {top5:.2f} ({(time.time() - t0) / 60:.1f} min)",
                  flush=True)
            best = max(best, top1)
            ck = {"model": model.module.state_dict(), "ema": ema_model.state_dict(),
                  "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(),
                  "scaler": scaler.state_dict(), "p_model": da.p_model.cpu(), "epoch": epoch + 1, "best": best}
            torch.save(ck, os.path.join(args.out, "last.pth"))
            if top1 >= best:
                torch.save(ema_model.state_dict(), os.path.join(args.out, "best_ema.pth"))
        dist.barrier()

    if rank == 0:
        wandb.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
