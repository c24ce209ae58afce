"""iCaRL on ImageNet-Subset (100 classes, 10 incremental steps).

Training uses cross-entropy on new classes + exemplars with BCE-style
distillation on old logits; evaluation uses the nearest-mean-of-exemplars (NME)
classifier as in the iCaRL paper.

torchrun --nproc_per_node 4 icarl_ncm_imagenet_subset.py \
    --data-root /datasets/imagenet100 --steps 10 --mem-per-class 20
"""
import argparse
import copy
import os
import random

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Subset
from torch.utils.data.distributed import DistributedSampler
from torchvision import datasets, models, transforms

parser = argparse.ArgumentParser()
parser.add_argument("--data-root", default="/datasets/imagenet100")
parser.add_argument("--save", default="./icarl_ckpt")
parser.add_argument("--steps", type=int, default=10)
parser.add_argument("--mem-per-class", type=int, default=20)
parser.add_argument("--epochs", type=int, default=60)
parser.add_argument("--bs", type=int, default=64)
parser.add_argument("--lr", type=float, default=0.1)
parser.add_argument("--workers", type=int, default=8)
parser.add_argument("--seed", type=int, default=1993)


class ICaRLNet(nn.Module):
    def __init__(self, n_classes):
        super().__init__()
        self.features = models.resnet18()
        self.features.fc = nn.Identity()
        self.classifier = nn.Linear(512, n_classes)

    def add_classes(self, n_new):
        old = self.classifier
        self.classifier = nn.Linear(512, old.out_features + n_new).to(old.weight.device)
        with torch.no_grad():
            self.classifier.weight[: old.out_features] = old.weight
            self.classifier.bias[: old.out_features] = old.bias

    def extract_features(self, x):
        return F.normalize(self.features(x), dim=1)

    def forward(self, x):
        return self.classifier(self.features(x))


@torch.no_grad()
def class_means(model, dataset, memory, device, n_classes):
    """Mean normalised feature of each class's exemplars (with flip TTA)."""
    means = torch.zeros(n_classes, 512, device=device)
    model.eval()
    for c in range(n_classes):
        loader = DataLoader(Subset(dataset, memory[c]), batch_size=128, num_workers=4)
        feats = []
        for x, _ in loader:
            x = x.to(device)
            f = model.extract_features(x) + model.extract_features(torch.flip(x, dims=[3]))
            feats.append(F.normalize(f, dim=1))
        means[c] = F.normalize(torch.cat(feats).mean(0), dim=0)
    return means


@torch.no_grad()
def nme_accuracy(model, loader, means, device):
    model.eval()
    stats = torch.zeros(2, device=device)
    for x, y in loader:
        x, y = x.to(device), y.to(device)
        f = model.extract_features(x)
        pred = torch.cdist(f, means).argmin(1)
        stats[0] += (pred == y).sum()
        stats[1] += y.numel()
    dist.all_reduce(stats)
    return (stats[0] / stats[1]).item()


def main():
    args = parser.parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl", init_method="env://")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)

    norm = transforms.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])
    train_tf = transforms.Compose([transforms.RandomResizedCrop(224), transforms.RandomHorizontalFlip(),
                                   transforms.ColorJitter(0.4, 0.4, 0.4), transforms.ToTensor(), norm])
    eval_tf = transforms.Compose([transforms.Resize(256), transforms.CenterCrop(224),
                                  transforms.ToTensor(), norm])
    train_set = datasets.ImageFolder(os.path.join(args.data_root, "train"), train_tf)
    train_eval = datasets.ImageFolder(os.path.join(args.data_root, "train"), eval_tf)
    val_set = datasets.ImageFolder(os.path.join(args.data_root, "val"), eval_tf)
    train_targets = np.array(train_set.targets)
    val_targets = np.array(val_set.targets)

    n_total = len(train_set.classes)
    per_step = n_total // args.steps
    # fixed seed: the exemplar draw is identical on all ranks
    mem_rng = np.random.RandomState(args.seed)
    memory = {}

    net = ICaRLNet(per_step).to(device)
    net = nn.SyncBatchNorm.convert_sync_batchnorm(net)
    model = DDP(net, device_ids=[local_rank])
    old_net = None
    if rank == 0:
        os.makedirs(args.save, exist_ok=True)

    for step in range(args.steps):
        lo, hi = step * per_step, (step + 1) * per_step
        if step > 0:
            old_net = copy.deepcopy(model.module).eval()
            for p in old_net.parameters():
                p.requires_grad = False
            model.module.add_classes(per_step)
            model = DDP(model.module, device_ids=[local_rank])

        new_idx = np.where((train_targets >= lo) & (train_targets < hi))[0].tolist()
        exemplars = [i for c in range(lo) for i in memory[c]]
        step_set = Subset(train_set, new_idx + exemplars)
        sampler = DistributedSampler(step_set, shuffle=True)
        loader = DataLoader(step_set, batch_size=args.bs, sampler=sampler,
                            num_workers=args.workers, pin_memory=True, drop_last=True)
        opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9, weight_decay=1e-5)
        sched = torch.optim.lr_scheduler.MultiStepLR(opt, [int(args.epochs * 0.5), int(args.epochs * 0.75)])

        for epoch in range(args.epochs):
            sampler.set_epoch(epoch)
            model.train()
            for x, y in loader:
                x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
                logits = model(x)
                target = F.one_hot(y, hi).float()
                if old_net is not None:
                    with torch.no_grad():
                        target[:, :lo] = torch.sigmoid(old_net(x))
                loss = F.binary_cross_entropy_with_logits(logits, target)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
            sched.step()
            if rank == 0 and (epoch + 1) % 10 == 0:
                print(f"[step {step}] epoch {epoch + 1} loss {loss.item():.4f}", flush=True)

        # random exemplars for the new classes (iCaRL-random baseline)
        for c in range(lo, hi):
            idx = np.where(train_targets == c)[0]
            memory[c] = mem_rng.choice(idx, args.mem_per_class, replace=False).tolist()

        means = class_means(model, train_eval, memory, device, hi)
        seen = np.where(val_targets < hi)[0].tolist()
        val_sub = Subset(val_set, seen)
        val_loader = DataLoader(val_sub, batch_size=256, num_workers=args.workers,
                                sampler=DistributedSampler(val_sub, shuffle=False))
        acc = nme_accuracy(model, val_loader, means, device)
        if rank == 0:
            print(f"== step {step}: {hi} classes, NME top-1 {acc:.4f}", flush=True)
            torch.save({"step": step, "model": model.module.state_dict(),
                        "memory": memory, "class_means": means.cpu()},
                       os.path.join(args.save, f"step{step}.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
