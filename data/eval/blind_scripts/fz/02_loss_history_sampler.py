"""Loss-proportional importance sampling for ImageFolder classification (DDP).

A running (EMA) history of every training sample's loss is kept.  At the start
of each epoch the history is turned into sampling probabilities
    p_i  ~  (loss_i + eps) ** alpha
mixed with the uniform distribution, and a distributed weighted sampler draws
the epoch.  The update is debiased with w_i = 1 / (N p_i).

torchrun --nnodes=1 --nproc_per_node=8 02_loss_history_sampler.py \
    --train-dir /datasets/food101/train --val-dir /datasets/food101/val
"""
import argparse
import logging
import math
import os

import timm
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Sampler, Subset
from torchvision import datasets, transforms

log = logging.getLogger("is")


class WithIndex(Dataset):
    def __init__(self, ds):
        self.ds = ds

    def __len__(self):
        return len(self.ds)

    def __getitem__(self, i):
        img, target = self.ds[i]
        return img, target, i


class DistributedWeightedSampler(Sampler):
    """Draws num_samples indices with replacement from `weights` and splits them
    across ranks. All ranks use the same generator seed so the draw is identical
    everywhere and each rank takes a disjoint slice of it."""

    def __init__(self, weights, num_replicas, rank, num_samples=None, seed=0):
        self.weights = torch.as_tensor(weights, dtype=torch.double)
        self.num_replicas = num_replicas
        self.rank = rank
        total = num_samples or len(self.weights)
        self.num_samples = math.ceil(total / num_replicas)
        self.total_size = self.num_samples * num_replicas
        self.seed = seed
        self.epoch = 0

    def set_weights(self, weights):
        self.weights = torch.as_tensor(weights, dtype=torch.double)

    def set_epoch(self, epoch):
        self.epoch = epoch

    def __iter__(self):
        g = torch.Generator()
        g.manual_seed(self.seed + self.epoch)
        idx = torch.multinomial(self.weights, self.total_size, replacement=True, generator=g)
        return iter(idx[self.rank:self.total_size:self.num_replicas].tolist())

    def __len__(self):
        return self.num_samples


class LossHistory:
    """EMA of the per-sample training loss, indexed by dataset position."""

    def __init__(self, n, momentum=0.9, init=None):
        self.momentum = momentum
        self.ema = torch.full((n,), float(init) if init is not None else 1.0)
        self.sum = torch.zeros(n)
        self.cnt = torch.zeros(n)

    def record(self, idx, loss):
        idx = idx.cpu()
        self.sum.index_add_(0, idx, loss.detach().float().cpu())
        self.cnt.index_add_(0, idx, torch.ones_like(idx, dtype=torch.float))

    def sync_and_update(self):
        dist.all_reduce(self.sum, op=dist.ReduceOp.SUM)
        dist.all_reduce(self.cnt, op=dist.ReduceOp.SUM)
        seen = self.cnt > 0
        mean = self.sum[seen] / self.cnt[seen]
        self.ema[seen] = self.momentum * self.ema[seen] + (1 - self.momentum) * mean
        self.sum.zero_()
        self.cnt.zero_()

    def probabilities(self, alpha, uniform_mix, eps=1e-3):
        p = (self.ema + eps).pow(alpha)
        p = p / p.sum()
        return (1 - uniform_mix) * p + uniform_mix / p.numel()


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--train-dir", required=True)
    ap.add_argument("--val-dir", required=True)
    ap.add_argument("--model", default="resnet50")
    ap.add_argument("--pretrained", action="store_true")
    ap.add_argument("--epochs", type=int, default=30)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--base-lr", type=float, default=1e-3, help="AdamW lr for 512 images")
    ap.add_argument("--weight-decay", type=float, default=0.05)
    ap.add_argument("--alpha", type=float, default=0.5)
    ap.add_argument("--uniform-mix", type=float, default=0.3)
    ap.add_argument("--is-start", type=int, default=2, help="epoch at which importance sampling starts")
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--output", default="output/is_food101")
    ap.add_argument("--seed", type=int, default=42)
    return ap.parse_args()


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{local_rank}")
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(message)s")
    torch.manual_seed(args.seed)

    normalize = transforms.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])
    train_tf = transforms.Compose([transforms.RandomResizedCrop(224), transforms.RandomHorizontalFlip(),
                                   transforms.ToTensor(), normalize])
    val_tf = transforms.Compose([transforms.Resize(256), transforms.CenterCrop(224),
                                 transforms.ToTensor(), normalize])
    train_set = WithIndex(datasets.ImageFolder(args.train_dir, train_tf))
    val_set = datasets.ImageFolder(args.val_dir, val_tf)
    num_classes = len(val_set.classes)
    n = len(train_set)

    history = LossHistory(n, init=math.log(num_classes))
    sampler = DistributedWeightedSampler(torch.ones(n), world, rank, seed=args.seed)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler, num_workers=args.workers,
                              pin_memory=True, drop_last=True, persistent_workers=False)
    val_loader = DataLoader(Subset(val_set, range(rank, len(val_set), world)), batch_size=128,
                            num_workers=args.workers, pin_memory=True)

    model = timm.create_model(args.model, pretrained=args.pretrained, num_classes=num_classes).to(device)
    model = DDP(model, device_ids=[local_rank])
    lr = args.base_lr * args.batch_size * world / 512
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=args.weight_decay)
    steps = args.epochs * len(train_loader)
    warmup = len(train_loader)
    sched = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(s, steps) / steps)))
    scaler = torch.cuda.amp.GradScaler()
    if rank == 0:
        os.makedirs(args.output, exist_ok=True)

    probs = torch.full((n,), 1.0 / n)
    for epoch in range(args.epochs):
        if epoch >= args.is_start:
            probs = history.probabilities(args.alpha, args.uniform_mix)
            sampler.set_weights(probs)
        sampler.set_epoch(epoch)
        # importance weights for the unbiased update, indexed by sample id
        iw = (1.0 / (n * probs)).to(device)

        model.train()
        tot = torch.zeros(2, device=device)
        for it, (x, y, idx) in enumerate(train_loader):
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            idx_d = idx.to(device, non_blocking=True)
            with torch.autocast(device_type="cuda", dtype=torch.float16):
                out = model(x)
                per_sample = F.cross_entropy(out, y, reduction="none")
            loss = (per_sample.float() * iw[idx_d]).mean()
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            sched.step()
            history.record(idx, per_sample)
            tot[0] += per_sample.detach().float().sum()
            tot[1] += y.numel()
            if it % 100 == 0:
                log.info("ep %d it %d/%d loss %.4f lr %.2e", epoch, it, len(train_loader), loss.item(),
                         optimizer.param_groups[0]["lr"])
        history.sync_and_update()
        dist.all_reduce(tot)

        model.eval()
        stats = torch.zeros(2, device=device)
        with torch.no_grad():
            for x, y in val_loader:
                x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
                with torch.autocast(device_type="cuda", dtype=torch.float16):
                    out = model.module(x)
                stats[0] += (out.argmax(-1) == y).sum()
                stats[1] += y.numel()
        dist.all_reduce(stats)
        if rank == 0:
            ent = -(probs * probs.clamp_min(1e-12).log()).sum().item()
            log.info("epoch %d train_loss %.4f val_acc %.4f sampling_entropy %.3f (uniform %.3f)",
                     epoch, (tot[0] / tot[1]).item(), (stats[0] / stats[1]).item(), ent, math.log(n))
            torch.save({"epoch": epoch, "model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                        "loss_ema": history.ema}, os.path.join(args.output, "checkpoint.pth"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
