"""Active Bias (Chang et al., 2017): emphasise uncertain samples by sampling in
proportion to the variance of their gold-label probability over past epochs.
Web-scale noisy ImageFolder data (e.g. WebVision mini / Food-101N), DDP.

Also adds an auxiliary loss on the samples of a batch whose gold probability is
below `--hard-thresh` (online hard-example emphasis).

    torchrun --nnodes=2 --nproc_per_node=8 --rdzv-backend=c10d --rdzv-endpoint=$HEAD:29400 \
        18_active_bias_resume.py --data /shared/food101n --out /shared/runs/active_bias --resume auto
"""
import argparse
import math
import os

import timm
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import wandb
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Sampler, Subset
from torchvision import datasets


class Indexed(Dataset):
    def __init__(self, base):
        self.base = base

    def __len__(self):
        return len(self.base)

    def __getitem__(self, i):
        x, y = self.base[i]
        return x, y, i


class SeededWeightedSampler(Sampler):
    """Same multinomial draw on every rank (seed + epoch), each rank keeps a stride."""

    def __init__(self, n, num_replicas, rank, seed=0):
        self.weights = torch.ones(n, dtype=torch.double)
        self.num_replicas, self.rank, self.seed, self.epoch = num_replicas, rank, seed, 0
        self.num_samples = math.ceil(n / num_replicas)

    def set_epoch(self, epoch):
        self.epoch = epoch

    def __iter__(self):
        g = torch.Generator().manual_seed(self.seed + self.epoch)
        draw = torch.multinomial(self.weights, self.num_samples * self.num_replicas, replacement=True, generator=g)
        return iter(draw[self.rank::self.num_replicas].tolist())

    def __len__(self):
        return self.num_samples


class ProbHistory:
    """Welford running mean / variance of p(gold) for every sample, on the GPU."""

    def __init__(self, n, device):
        self.count = torch.zeros(n, device=device)
        self.mean = torch.zeros(n, device=device)
        self.m2 = torch.zeros(n, device=device)

    def update(self, epoch_sum, epoch_cnt):
        hit = epoch_cnt > 0
        x = epoch_sum[hit] / epoch_cnt[hit]
        self.count[hit] += 1
        delta = x - self.mean[hit]
        self.mean[hit] += delta / self.count[hit]
        self.m2[hit] += delta * (x - self.mean[hit])

    def std(self):
        return torch.sqrt(self.m2 / (self.count - 1).clamp(min=1))

    def state_dict(self):
        return {"count": self.count.cpu(), "mean": self.mean.cpu(), "m2": self.m2.cpu()}

    def load_state_dict(self, sd):
        for k in ("count", "mean", "m2"):
            getattr(self, k).copy_(sd[k])


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--model", default="resnet50")
    p.add_argument("--epochs", type=int, default=40)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--lr", type=float, default=0.02, help="for a global batch of 256")
    p.add_argument("--eps", type=float, default=0.05, help="smoothing added to the std")
    p.add_argument("--ab-start", type=int, default=3)
    p.add_argument("--hard-thresh", type=float, default=0.2)
    p.add_argument("--hard-weight", type=float, default=0.5)
    p.add_argument("--out", required=True, help="must be on storage shared by all nodes")
    p.add_argument("--resume", default="", help="path, or 'auto' for <out>/last.pt")
    p.add_argument("--wandb-project", default="active-bias")
    return p.parse_args()


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(0)

    cfg = timm.data.resolve_data_config({}, model=args.model)
    train_base = datasets.ImageFolder(os.path.join(args.data, "train"),
                                      timm.data.create_transform(**cfg, is_training=True))
    val_set = datasets.ImageFolder(os.path.join(args.data, "val"), timm.data.create_transform(**cfg))
    train_set = Indexed(train_base)
    n, num_classes = len(train_set), len(train_base.classes)

    sampler = SeededWeightedSampler(n, world, rank, seed=11)
    loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler, num_workers=8,
                        pin_memory=True, drop_last=True, persistent_workers=True)
    val_loader = DataLoader(Subset(val_set, range(rank, len(val_set), world)), batch_size=128, num_workers=8)

    model = timm.create_model(args.model, pretrained=True, num_classes=num_classes)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).to(device)
    model = DDP(model, device_ids=[local_rank])
    lr = args.lr * args.batch_size * world / 256
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9, weight_decay=1e-4)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.epochs)
    history = ProbHistory(n, device)

    start_epoch = 0
    resume = os.path.join(args.out, "last.pt") if args.resume == "auto" else args.resume
    if resume and os.path.isfile(resume):
        # everything in the checkpoint is global (no per-rank shards), so the
        # job may come back with a different number of GPUs
        ckpt = torch.load(resume, map_location="cpu")
        model.module.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        scheduler.load_state_dict(ckpt["scheduler"])
        history.load_state_dict(ckpt["history"])
        start_epoch = ckpt["epoch"] + 1
        if ckpt["world_size"] != world:  # keep the lr proportional to the new global batch
            scale = world / ckpt["world_size"]
            for group in optimizer.param_groups:
                group["lr"] *= scale
                group["initial_lr"] *= scale
            scheduler.base_lrs = [b * scale for b in scheduler.base_lrs]

    run = None
    if rank == 0:
        run = wandb.init(project=args.wandb_project, config=vars(args) | {"world_size": world}, resume="allow",
                         id=os.path.basename(os.path.normpath(args.out)))

    for epoch in range(start_epoch, args.epochs):
        if epoch >= args.ab_start:
            sampler.weights = (history.std() + args.eps).double().cpu()
        sampler.set_epoch(epoch)
        model.train()
        p_sum = torch.zeros(n, device=device)
        p_cnt = torch.zeros(n, device=device)
        stats = torch.zeros(3, device=device)
        for x, y, idx in loader:
            x, y, idx = x.to(device, non_blocking=True), y.to(device, non_blocking=True), idx.to(device)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = model(x)
            logits = logits.float()
            per = F.cross_entropy(logits, y, reduction="none")
            p_gold = logits.softmax(-1).gather(1, y[:, None]).squeeze(1)
            hard = (p_gold < args.hard_thresh).float().detach()
            # every rank runs backward every step, even when its batch has no hard sample
            hard_term = (per * hard).sum() / hard.sum().clamp(min=1.0)
            loss = per.mean() + args.hard_weight * hard_term
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            p_sum.index_add_(0, idx, p_gold.detach())
            p_cnt.index_add_(0, idx, torch.ones_like(p_gold))
            stats += torch.stack([per.detach().sum(), hard.sum(), torch.tensor(float(y.numel()), device=device)])
        scheduler.step()
        dist.all_reduce(p_sum)
        dist.all_reduce(p_cnt)
        dist.all_reduce(stats)
        history.update(p_sum, p_cnt)

        model.eval()
        acc = torch.zeros(2, device=device)
        with torch.no_grad():
            for x, y in val_loader:
                x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    acc[0] += (model.module(x).argmax(1) == y).sum()
                acc[1] += y.numel()
        dist.all_reduce(acc)

        if rank == 0:
            log = {"epoch": epoch, "train/loss": (stats[0] / stats[2]).item(),
                   "train/hard_frac": (stats[1] / stats[2]).item(), "val/acc": (acc[0] / acc[1]).item(),
                   "sampling/max_over_mean": (sampler.weights.max() / sampler.weights.mean()).item()}
            run.log(log)
            print(log, flush=True)
            os.makedirs(args.out, exist_ok=True)
            tmp = os.path.join(args.out, "last.pt.tmp")
            torch.save({"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                        "scheduler": scheduler.state_dict(), "history": history.state_dict(),
                        "epoch": epoch, "world_size": world}, tmp)
            os.replace(tmp, os.path.join(args.out, "last.pt"))
        dist.barrier()

    if run is not None:
        run.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
