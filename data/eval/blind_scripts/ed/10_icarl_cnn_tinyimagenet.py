"""iCaRL-CNN on Tiny-ImageNet (200 classes, 10 tasks of 20), DDP.

Cross-entropy on all seen classes + KD on old logits, exemplars chosen by
herding in feature space. Herding is done collectively: each rank embeds its
own shard of the task data and the per-class features are all-gathered, so we
do not have to run a full pass over the task on a single GPU.

    torchrun --nproc_per_node=8 10_icarl_cnn_tinyimagenet.py --root /data/tiny-imagenet-200
"""
import argparse
import copy
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchvision
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler
from torchvision import transforms

MEAN, STD = (0.4802, 0.4481, 0.3975), (0.2302, 0.2265, 0.2262)


class Indexed(Dataset):
    """(image, remapped label, index into the base dataset)."""

    def __init__(self, base, indices, remap):
        self.base, self.indices, self.remap = base, list(indices), remap

    def __len__(self):
        return len(self.indices)

    def __getitem__(self, k):
        i = self.indices[k]
        x, y = self.base[i]
        return x, int(self.remap[y]), i


class Net(nn.Module):
    def __init__(self, n_classes=200):
        super().__init__()
        r = torchvision.models.resnet18()
        r.conv1 = nn.Conv2d(3, 64, 3, 1, 1, bias=False)
        r.fc = nn.Identity()
        self.backbone = r
        self.fc = nn.Linear(512, n_classes)

    def features(self, x):
        return self.backbone(x)

    def forward(self, x):
        return self.fc(self.features(x))


def herding(feats, m):
    mu = feats.mean(0)
    acc = torch.zeros_like(mu)
    chosen = []
    for k in range(1, min(m, feats.size(0)) + 1):
        d = ((mu[None] - (acc[None] + feats) / k) ** 2).sum(1)
        if chosen:
            d[chosen] = float("inf")
        j = int(d.argmin())
        chosen.append(j)
        acc += feats[j]
    return chosen


@torch.no_grad()
def build_exemplars(net, loader, classes, m, device, world):
    net.eval()
    feats, labels, idxs = [], [], []
    for x, y, i in loader:
        feats.append(F.normalize(net.features(x.to(device, non_blocking=True)), dim=1))
        labels.append(y.to(device))
        idxs.append(i.to(device))
    feats, labels, idxs = torch.cat(feats), torch.cat(labels), torch.cat(idxs)
    exemplars = {}
    for c in classes:
        sel = labels == c
        f_c, i_c = feats[sel], idxs[sel]
        f_all = [torch.empty_like(f_c) for _ in range(world)]
        i_all = [torch.empty_like(i_c) for _ in range(world)]
        dist.all_gather(f_all, f_c)
        dist.all_gather(i_all, i_c)
        f_all, i_all = torch.cat(f_all), torch.cat(i_all)
        exemplars[c] = [int(i_all[j]) for j in herding(f_all, m)]
    return exemplars


@torch.no_grad()
def evaluate(net, loader, n_seen, per_task, device):
    net.eval()
    n_t = n_seen // per_task
    stats = torch.zeros(n_t, 2, device=device)
    for x, y, _ in loader:
        x, y = x.to(device), y.to(device)
        pred = net(x)[:, :n_seen].argmax(1)
        task_of = y // per_task
        stats[:, 0] += torch.bincount(task_of[pred == y], minlength=n_t).float()
        stats[:, 1] += torch.bincount(task_of, minlength=n_t).float()
    dist.all_reduce(stats)
    return (100 * stats[:, 0] / stats[:, 1]).tolist()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", default="/data/tiny-imagenet-200")
    ap.add_argument("--out", default="./runs/icarl_cnn_tiny")
    ap.add_argument("--tasks", type=int, default=10)
    ap.add_argument("--memory", type=int, default=2000)
    ap.add_argument("--epochs", type=int, default=100)
    ap.add_argument("--lr", type=float, default=0.1)
    ap.add_argument("--batch_size", type=int, default=256, help="global")
    ap.add_argument("--T", type=float, default=2.0)
    ap.add_argument("--seed", type=int, default=1993)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(args.seed)

    aug = transforms.Compose([transforms.RandomCrop(64, padding=8), transforms.RandomHorizontalFlip(),
                              transforms.ToTensor(), transforms.Normalize(MEAN, STD)])
    plain = transforms.Compose([transforms.ToTensor(), transforms.Normalize(MEAN, STD)])
    train_aug = torchvision.datasets.ImageFolder(os.path.join(args.root, "train"), aug)
    train_plain = torchvision.datasets.ImageFolder(os.path.join(args.root, "train"), plain)
    val_set = torchvision.datasets.ImageFolder(os.path.join(args.root, "val"), plain)

    remap = np.argsort(np.random.RandomState(args.seed).permutation(200))
    y_train = remap[np.asarray(train_aug.targets)]
    y_val = remap[np.asarray(val_set.targets)]
    per_task = 200 // args.tasks

    net = Net(200).to(device)
    model = DDP(net, device_ids=[local_rank])
    old_net, exemplars = None, {}
    acc = np.full((args.tasks, args.tasks), np.nan)

    for t in range(args.tasks):
        lo, hi = t * per_task, (t + 1) * per_task
        new_idx = np.where((y_train >= lo) & (y_train < hi))[0].tolist()
        mem_idx = [i for c in sorted(exemplars) for i in exemplars[c]]
        train_ds = Indexed(train_aug, new_idx + mem_idx, remap)
        sampler = DistributedSampler(train_ds, shuffle=True, seed=args.seed)
        loader = DataLoader(train_ds, batch_size=args.batch_size // world, sampler=sampler,
                            num_workers=8, pin_memory=True, drop_last=True)
        opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9, weight_decay=5e-4)
        sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=args.lr, epochs=args.epochs,
                                                    steps_per_epoch=len(loader))
        start = time.time()
        for epoch in range(args.epochs):
            sampler.set_epoch(epoch)
            model.train()
            for x, y, _ in loader:
                x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
                logits = model(x)[:, :hi]
                loss = F.cross_entropy(logits, y)
                if old_net is not None:
                    with torch.no_grad():
                        old = old_net(x)[:, :lo]
                    loss = loss + F.kl_div(F.log_softmax(logits[:, :lo] / args.T, 1),
                                           F.softmax(old / args.T, 1), reduction="batchmean") * args.T ** 2
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                sched.step()
            if rank == 0 and epoch % 20 == 0:
                print(f"[t{t}] epoch {epoch} loss {loss.item():.3f} ({time.time() - start:.0f}s)", flush=True)

        # shrink old exemplar sets, build new ones with distributed herding
        m = args.memory // hi
        exemplars = {c: v[:m] for c, v in exemplars.items()}
        task_ds = Indexed(train_plain, new_idx, remap)
        task_loader = DataLoader(task_ds, batch_size=256, num_workers=8,
                                 sampler=DistributedSampler(task_ds, shuffle=False))
        exemplars.update(build_exemplars(net, task_loader, range(lo, hi), m, device, world))

        val_ds = Indexed(val_set, np.where(y_val < hi)[0].tolist(), remap)
        val_idx = list(range(rank, len(val_ds), world))
        val_loader = DataLoader(Subset(val_ds, val_idx), batch_size=256, num_workers=4)
        acc[t, :t + 1] = evaluate(net, val_loader, hi, per_task, device)
        if rank == 0:
            print(f"task {t}: avg {np.nanmean(acc[t]):.2f} | {np.round(acc[t, :t + 1], 1).tolist()}", flush=True)
            os.makedirs(args.out, exist_ok=True)
            torch.save({"model": net.state_dict(), "exemplars": exemplars, "acc": acc},
                       os.path.join(args.out, f"task{t:02d}.pt"))
        old_net = copy.deepcopy(net).eval()
        old_net.requires_grad_(False)

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
