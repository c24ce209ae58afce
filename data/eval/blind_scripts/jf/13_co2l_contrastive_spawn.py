"""Contrastive continual learning (Co2L-style) on Seq-CIFAR-10, launched with mp.spawn.

* asymmetric supervised contrastive loss, negatives gathered from all GPUs
* instance-wise relation distillation (IRD) from the model of the previous task
* SyncBatchNorm, so the small per-GPU batches share BN statistics
* gradient accumulation with DDP.no_sync()
* nearest-class-mean evaluation with class means from the replay buffer

    python 13_co2l_contrastive_spawn.py --gpus 4 --data /data/cifar10
"""
import argparse
import copy
import os

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_fn
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Subset
from torch.utils.data.distributed import DistributedSampler
from torchvision import datasets, models, transforms


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--gpus", type=int, default=torch.cuda.device_count())
    p.add_argument("--data", default="/data/cifar10")
    p.add_argument("--save", default="./co2l_ckpt")
    p.add_argument("--port", default="29531")
    p.add_argument("--start-epochs", type=int, default=500)
    p.add_argument("--epochs", type=int, default=100)
    p.add_argument("--batch-size", type=int, default=512, help="global, after accumulation")
    p.add_argument("--accum", type=int, default=2)
    p.add_argument("--lr", type=float, default=0.5)
    p.add_argument("--temp", type=float, default=0.5)
    p.add_argument("--current-temp", type=float, default=0.2)
    p.add_argument("--past-temp", type=float, default=0.01)
    p.add_argument("--distill-power", type=float, default=1.0)
    p.add_argument("--mem-size", type=int, default=500)
    return p.parse_args()


class TwoCrop:
    def __init__(self, tf):
        self.tf = tf

    def __call__(self, x):
        return [self.tf(x), self.tf(x)]


class SupConNet(nn.Module):
    def __init__(self, feat_dim=128):
        super().__init__()
        enc = models.resnet18()
        enc.conv1 = nn.Conv2d(3, 64, 3, 1, 1, bias=False)
        enc.maxpool = nn.Identity()
        enc.fc = nn.Identity()
        self.encoder = enc
        self.head = nn.Sequential(nn.Linear(512, 512), nn.ReLU(inplace=True), nn.Linear(512, feat_dim))

    def forward(self, x):
        return F.normalize(self.head(self.encoder(x)), dim=1)


def asym_supcon(z_local, y_local, z_all, y_all, offset, new_classes, temp):
    """Anchors are the local views of current-task samples; contrast set is the global batch."""
    n = z_local.size(0)
    logits = z_local @ z_all.T / temp
    self_mask = torch.zeros_like(logits, dtype=torch.bool)
    self_mask[torch.arange(n), offset + torch.arange(n)] = True
    logits = logits.masked_fill(self_mask, -1e9)
    pos = (y_local[:, None] == y_all[None, :]) & ~self_mask
    log_prob = logits - torch.logsumexp(logits, dim=1, keepdim=True)
    mean_log_pos = (log_prob * pos).sum(1) / pos.sum(1).clamp(min=1)
    anchor = torch.isin(y_local, new_classes)
    return -(mean_log_pos[anchor]).mean() if anchor.any() else mean_log_pos.sum() * 0.0


def ird(z_cur, z_past, t_cur, t_past):
    n = z_cur.size(0)
    off = ~torch.eye(n, dtype=torch.bool, device=z_cur.device)
    s_cur = (z_cur @ z_cur.T / t_cur)[off].view(n, n - 1)
    s_past = (z_past @ z_past.T / t_past)[off].view(n, n - 1)
    return (-F.softmax(s_past, 1) * F.log_softmax(s_cur, 1)).sum(1).mean()


def worker(local_rank, world, args):
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", args.port)
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl", rank=local_rank, world_size=world)
    device = torch.device("cuda", local_rank)
    torch.manual_seed(local_rank)

    norm = transforms.Normalize((0.4914, 0.4822, 0.4465), (0.2023, 0.1994, 0.2010))
    aug = transforms.Compose([
        transforms.RandomResizedCrop(32, scale=(0.2, 1.0)), transforms.RandomHorizontalFlip(),
        transforms.RandomApply([transforms.ColorJitter(0.4, 0.4, 0.4, 0.1)], p=0.8),
        transforms.RandomGrayscale(p=0.2), transforms.ToTensor(), norm])
    plain = transforms.Compose([transforms.ToTensor(), norm])
    train_set = datasets.CIFAR10(args.data, train=True, transform=TwoCrop(aug))
    feat_set = datasets.CIFAR10(args.data, train=True, transform=plain)
    test_set = datasets.CIFAR10(args.data, train=False, transform=plain)
    y_train, y_test = np.array(train_set.targets), np.array(test_set.targets)
    tasks = [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9]]

    net = nn.SyncBatchNorm.convert_sync_batchnorm(SupConNet()).to(device)
    model = DDP(net, device_ids=[local_rank])
    micro_bs = args.batch_size // (world * args.accum)
    buffer_idx = []
    past = None

    for t, classes in enumerate(tasks):
        new_cls = torch.tensor(classes, device=device)
        ds = Subset(train_set, np.where(np.isin(y_train, classes))[0].tolist() + buffer_idx)
        sampler = DistributedSampler(ds, shuffle=True, drop_last=True)
        loader = DataLoader(ds, batch_size=micro_bs, sampler=sampler, num_workers=4,
                            pin_memory=True, drop_last=True)
        opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9, weight_decay=1e-4)
        epochs = args.start_epochs if t == 0 else args.epochs
        sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, epochs * (len(loader) // args.accum))

        for ep in range(epochs):
            sampler.set_epoch(ep)
            opt.zero_grad(set_to_none=True)
            for it, ((v1, v2), y) in enumerate(loader):
                x = torch.cat([v1, v2]).to(device, non_blocking=True)
                y = y.to(device, non_blocking=True).repeat(2)
                sync_now = (it + 1) % args.accum == 0
                ctx = model.no_sync() if not sync_now else torch.enable_grad()
                with ctx:
                    z = model(x)
                    z_all = torch.cat(dist_fn.all_gather(z), 0)
                    y_all = torch.cat([torch.empty_like(y) for _ in range(world)])
                    dist.all_gather_into_tensor(y_all, y)
                    loss = asym_supcon(z, y, z_all, y_all, dist.get_rank() * z.size(0), new_cls, args.temp)
                    if past is not None:
                        with torch.no_grad():
                            z_past = past(x)
                        loss = loss + args.distill_power * ird(z, z_past, args.current_temp, args.past_temp)
                    (loss / args.accum).backward()
                if sync_now:
                    opt.step()
                    sched.step()
                    opt.zero_grad(set_to_none=True)
            if local_rank == 0 and ep % 20 == 0:
                print(f"task {t} ep {ep} loss {loss.item():.4f} lr {sched.get_last_lr()[0]:.4f}", flush=True)

        # class-balanced buffer over all seen classes, same generator on every rank
        rng = np.random.RandomState(t)
        seen = [c for cl in tasks[:t + 1] for c in cl]
        per_cls = args.mem_size // len(seen)
        buffer_idx = []
        for c in seen:
            buffer_idx += rng.choice(np.where(y_train == c)[0], per_cls, replace=False).tolist()

        # NCM evaluation on the encoder features
        net.eval()
        with torch.no_grad():
            sums = torch.zeros(10, 512, device=device)
            cnts = torch.zeros(10, device=device)
            for x, y in DataLoader(Subset(feat_set, buffer_idx[local_rank::world]), batch_size=256):
                f = F.normalize(net.encoder(x.to(device)), dim=1)
                y = y.to(device)
                sums.index_add_(0, y, f)
                cnts.index_add_(0, y, torch.ones_like(y, dtype=torch.float))
            dist.all_reduce(sums)
            dist.all_reduce(cnts)
            means = F.normalize(sums[seen] / cnts[seen, None], dim=1)
            seen_t = torch.tensor(seen, device=device)
            hit = torch.zeros(2, device=device)
            te_idx = np.where(np.isin(y_test, seen))[0][local_rank::world]
            for x, y in DataLoader(Subset(test_set, te_idx), batch_size=512):
                f = F.normalize(net.encoder(x.to(device)), dim=1)
                pred = seen_t[(f @ means.T).argmax(1)]
                hit[0] += (pred == y.to(device)).sum()
                hit[1] += y.numel()
            dist.all_reduce(hit)
        net.train()
        if local_rank == 0:
            print(f"== after task {t}: NCM acc on {len(seen)} classes {100 * hit[0] / hit[1]:.2f}", flush=True)
            os.makedirs(args.save, exist_ok=True)
            torch.save({"model": net.state_dict(), "buffer": buffer_idx, "task": t},
                       os.path.join(args.save, f"co2l_task{t}.pt"))

        past = copy.deepcopy(net).eval()
        for p in past.parameters():
            p.requires_grad_(False)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    args = get_args()
    mp.spawn(worker, args=(args.gpus, args), nprocs=args.gpus, join=True)
