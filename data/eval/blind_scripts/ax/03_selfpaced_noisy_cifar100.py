"""Self-paced learning on CIFAR-100 with synthetic label noise.

Every epoch the current model scores the training samples; only samples whose
loss is below the age parameter lambda are used for that epoch, and lambda grows
geometrically so harder samples are admitted over time.

Launch:
    torchrun --standalone --nproc_per_node=4 selfpaced_noisy_cifar100.py \
        --noise 0.4 --epochs 120
"""
import argparse
import logging
import os

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchvision
import torchvision.transforms as T
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler

log = logging.getLogger("spl")


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", default="/data/cifar100")
    ap.add_argument("--save-dir", default="checkpoints/spl")
    ap.add_argument("--noise", type=float, default=0.4)
    ap.add_argument("--epochs", type=int, default=120)
    ap.add_argument("--warmup-epochs", type=int, default=10)
    ap.add_argument("--bs", type=int, default=128)
    ap.add_argument("--lr", type=float, default=0.1)
    ap.add_argument("--lambda0-quantile", type=float, default=0.5)
    ap.add_argument("--lambda-growth", type=float, default=1.05)
    ap.add_argument("--seed", type=int, default=123)
    return ap.parse_args()


class NoisyCIFAR100(Dataset):
    """CIFAR-100 with symmetric label noise; returns the sample index too."""

    def __init__(self, base, noise, seed):
        self.base = base
        targets = np.array(base.targets)
        rng = np.random.RandomState(seed)
        flip = rng.rand(len(targets)) < noise
        targets[flip] = rng.randint(0, 100, flip.sum())
        self.targets = targets.tolist()

    def __len__(self):
        return len(self.base)

    def __getitem__(self, i):
        x, _ = self.base[i]
        return x, self.targets[i], i


def make_model():
    m = torchvision.models.resnet34(num_classes=100)
    m.conv1 = nn.Conv2d(3, 64, 3, 1, 1, bias=False)
    m.maxpool = nn.Identity()
    return m


@torch.no_grad()
def per_sample_losses(model, dataset, device):
    """Loss of every training sample in this rank's shard."""
    sampler = DistributedSampler(dataset, shuffle=False)
    loader = DataLoader(dataset, batch_size=512, sampler=sampler, num_workers=4)
    model.eval()
    idx_all, loss_all = [], []
    for x, y, idx in loader:
        out = model(x.to(device))
        loss = F.cross_entropy(out, y.to(device), reduction="none")
        idx_all.append(idx)
        loss_all.append(loss.cpu())
    return torch.cat(idx_all), torch.cat(loss_all)


def run_epoch(model, loader, opt, device):
    model.train()
    tot, n = torch.zeros(1, device=device), torch.zeros(1, device=device)
    for x, y, _ in loader:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        tot += loss.detach() * x.size(0)
        n += x.size(0)
    dist.all_reduce(tot)
    dist.all_reduce(n)
    return (tot / n).item()


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    c = torch.zeros(2, device=device)
    for x, y in loader:
        c[0] += (model(x.to(device)).argmax(1) == y.to(device)).sum()
        c[1] += y.numel()
    dist.all_reduce(c)
    return (c[0] / c[1]).item()


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank = dist.get_rank()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(args.seed)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format="%(asctime)s %(message)s")

    mean, std = (0.507, 0.487, 0.441), (0.267, 0.256, 0.276)
    train_tf = T.Compose([T.RandomCrop(32, 4), T.RandomHorizontalFlip(),
                          T.ToTensor(), T.Normalize(mean, std)])
    test_tf = T.Compose([T.ToTensor(), T.Normalize(mean, std)])
    # dataset is pre-downloaded to the shared filesystem
    train_base = torchvision.datasets.CIFAR100(args.root, train=True, transform=train_tf)
    score_base = torchvision.datasets.CIFAR100(args.root, train=True, transform=test_tf)
    test_set = torchvision.datasets.CIFAR100(args.root, train=False, transform=test_tf)
    train_set = NoisyCIFAR100(train_base, args.noise, args.seed)
    score_set = NoisyCIFAR100(score_base, args.noise, args.seed)

    test_loader = DataLoader(test_set, batch_size=512, num_workers=4,
                             sampler=DistributedSampler(test_set, shuffle=False))

    model = make_model().to(device)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    model = DDP(model, device_ids=[local_rank])
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9,
                          weight_decay=5e-4)
    sched = torch.optim.lr_scheduler.MultiStepLR(opt, milestones=[60, 90], gamma=0.1)

    full_sampler = DistributedSampler(train_set, shuffle=True, seed=args.seed)
    full_loader = DataLoader(train_set, batch_size=args.bs, sampler=full_sampler,
                             num_workers=6, pin_memory=True, drop_last=True)

    lam = None
    best = 0.0
    if rank == 0:
        os.makedirs(args.save_dir, exist_ok=True)

    for epoch in range(args.epochs):
        if epoch < args.warmup_epochs:
            full_sampler.set_epoch(epoch)
            loss = run_epoch(model, full_loader, opt, device)
            kept = len(train_set)
        else:
            idx, losses = per_sample_losses(model.module, score_set, device)
            if lam is None:
                # initial threshold: quantile of the global loss distribution
                q = torch.quantile(losses.to(device), args.lambda0_quantile)
                dist.all_reduce(q)
                lam = (q / dist.get_world_size()).item()
            else:
                lam *= args.lambda_growth
            easy = idx[losses < lam].tolist()
            easy_loader = DataLoader(Subset(train_set, easy), batch_size=args.bs,
                                     shuffle=True, num_workers=6, pin_memory=True,
                                     drop_last=True)
            loss = run_epoch(model, easy_loader, opt, device)
            kept_t = torch.tensor([len(easy)], device=device)
            dist.all_reduce(kept_t)
            kept = int(kept_t.item())
        sched.step()

        acc = evaluate(model, test_loader, device)
        log.info("epoch %d loss %.4f kept %d/%d lambda %s acc %.4f", epoch, loss, kept,
                 len(train_set), f"{lam:.3f}" if lam is not None else "-", acc)
        if rank == 0:
            ckpt = {"epoch": epoch, "model": model.module.state_dict(),
                    "opt": opt.state_dict(), "lambda": lam}
            torch.save(ckpt, os.path.join(args.save_dir, "last.pt"))
            if acc > best:
                best = acc
                torch.save(ckpt, os.path.join(args.save_dir, "best.pt"))

    log.info("best acc %.4f", best)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
