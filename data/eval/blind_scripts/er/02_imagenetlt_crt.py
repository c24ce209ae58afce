"""Classifier re-training (cRT) on ImageNet-LT, stage 2 of Decoupling (Kang et al. 2020).

Takes a backbone trained with instance-balanced sampling (stage 1), freezes it,
re-initialises the linear classifier and trains only the classifier for a few
epochs with class-balanced sampling.

    torchrun --nproc_per_node=4 imagenetlt_crt.py \
        --stage1 runs/imagenetlt_r50_stage1/final.pth --out runs/imagenetlt_r50_crt
"""
import argparse
import math
import os
from collections import OrderedDict

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Sampler
from torch.utils.tensorboard import SummaryWriter
from torchvision import transforms
from torchvision.models import resnet50


class ListDataset(Dataset):
    """ImageNet_LT_{train,val,test}.txt: '<relative path> <label>' per line."""

    def __init__(self, root, list_file, transform):
        self.root, self.transform = root, transform
        self.samples = []
        with open(list_file) as f:
            for line in f:
                path, label = line.split()
                self.samples.append((path, int(label)))
        self.targets = np.array([s[1] for s in self.samples], dtype=np.int64)

    def __len__(self):
        return len(self.samples)

    def __getitem__(self, i):
        path, label = self.samples[i]
        img = Image.open(os.path.join(self.root, path)).convert("RGB")
        return self.transform(img), label


class DistributedClassBalancedSampler(Sampler):
    """Pick a class uniformly, then an image of that class uniformly.

    Every rank draws the same global sequence (seeded by seed + epoch) and keeps
    its own strided slice, so ranks never see the same draw twice in one epoch.
    """

    def __init__(self, targets, num_samples, num_replicas, rank, seed=0):
        self.num_replicas, self.rank, self.seed = num_replicas, rank, seed
        self.epoch = 0
        self.per_class = [np.flatnonzero(targets == c) for c in range(targets.max() + 1)]
        self.per_rank = math.ceil(num_samples / num_replicas)
        self.total = self.per_rank * num_replicas

    def set_epoch(self, epoch):
        self.epoch = epoch

    def __iter__(self):
        rng = np.random.default_rng(self.seed + self.epoch)
        classes = rng.integers(0, len(self.per_class), size=self.total)
        offsets = rng.random(self.total)
        idx = [int(self.per_class[c][int(o * len(self.per_class[c]))]) for c, o in zip(classes, offsets)]
        return iter(idx[self.rank:self.total:self.num_replicas])

    def __len__(self):
        return self.per_rank


class ShardSampler(Sampler):
    """Contiguous, non-padded shard of the eval set for each rank."""

    def __init__(self, n, num_replicas, rank):
        per = math.ceil(n / num_replicas)
        self.indices = list(range(rank * per, min(n, (rank + 1) * per)))

    def __iter__(self):
        return iter(self.indices)

    def __len__(self):
        return len(self.indices)


def load_stage1(model, path):
    state = torch.load(path, map_location="cpu")
    state = state.get("state_dict", state)
    clean = OrderedDict((k[len("module."):] if k.startswith("module.") else k, v) for k, v in state.items())
    clean = {k: v for k, v in clean.items() if not k.startswith("fc.")}
    missing, unexpected = model.load_state_dict(clean, strict=False)
    assert set(missing) == {"fc.weight", "fc.bias"}, missing
    assert not unexpected, unexpected


@torch.no_grad()
def evaluate(net, loader, train_targets, num_classes, device):
    net.eval()
    correct = torch.zeros(num_classes, device=device)
    count = torch.zeros(num_classes, device=device)
    for x, y in loader:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        pred = net(x).argmax(1)
        count.index_add_(0, y, torch.ones_like(y, dtype=torch.float))
        correct.index_add_(0, y, (pred == y).float())
    dist.all_reduce(correct)
    dist.all_reduce(count)
    acc = (correct / count.clamp(min=1)).cpu().numpy()
    n_train = np.bincount(train_targets, minlength=num_classes)
    return {
        "all": 100.0 * correct.sum().item() / count.sum().item(),
        "many": 100.0 * acc[n_train > 100].mean(),
        "medium": 100.0 * acc[(n_train <= 100) & (n_train >= 20)].mean(),
        "few": 100.0 * acc[n_train < 20].mean(),
    }


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data-root", default="/data/imagenet")
    ap.add_argument("--list-dir", default="/data/ImageNet_LT")
    ap.add_argument("--stage1", required=True)
    ap.add_argument("--epochs", type=int, default=10)
    ap.add_argument("--batch-size", type=int, default=512, help="global batch size")
    ap.add_argument("--lr", type=float, default=0.2, help="lr at global batch 512")
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--out", default="runs/imagenetlt_crt")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{local_rank}")
    assert args.batch_size % world == 0
    per_gpu = args.batch_size // world

    norm = transforms.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])
    train_tf = transforms.Compose([transforms.RandomResizedCrop(224), transforms.RandomHorizontalFlip(),
                                   transforms.ToTensor(), norm])
    test_tf = transforms.Compose([transforms.Resize(256), transforms.CenterCrop(224),
                                  transforms.ToTensor(), norm])
    train_set = ListDataset(args.data_root, os.path.join(args.list_dir, "ImageNet_LT_train.txt"), train_tf)
    val_set = ListDataset(args.data_root, os.path.join(args.list_dir, "ImageNet_LT_test.txt"), test_tf)
    num_classes = 1000

    sampler = DistributedClassBalancedSampler(train_set.targets, len(train_set), world, rank, seed=args.seed)
    train_loader = DataLoader(train_set, batch_size=per_gpu, sampler=sampler, num_workers=args.workers,
                              pin_memory=True, drop_last=True)
    val_loader = DataLoader(val_set, batch_size=256, sampler=ShardSampler(len(val_set), world, rank),
                            num_workers=args.workers, pin_memory=True)

    model = resnet50(num_classes=num_classes)
    load_stage1(model, args.stage1)
    for name, p in model.named_parameters():
        p.requires_grad = name.startswith("fc.")
    nn.init.normal_(model.fc.weight, std=0.01)
    nn.init.zeros_(model.fc.bias)
    model.to(device)
    model = DDP(model, device_ids=[local_rank])

    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.SGD(params, lr=args.lr, momentum=0.9, weight_decay=5e-4)
    total_steps = args.epochs * len(train_loader)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=total_steps)

    writer = SummaryWriter(args.out) if rank == 0 else None
    step = 0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        # the backbone is frozen: keep its BN statistics from stage 1
        model.module.apply(lambda m: m.eval() if isinstance(m, nn.BatchNorm2d) else None)
        for x, y in train_loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            loss = F.cross_entropy(model(x), y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            scheduler.step()
            step += 1
            if step % 50 == 0:
                reduced = loss.detach().clone()
                dist.all_reduce(reduced, op=dist.ReduceOp.AVG)
                if writer is not None:
                    writer.add_scalar("train/loss", reduced.item(), step)
                    writer.add_scalar("train/lr", scheduler.get_last_lr()[0], step)

        stats = evaluate(model.module, val_loader, train_set.targets, num_classes, device)
        if rank == 0:
            print(f"[crt] epoch {epoch}: all {stats['all']:.2f} many {stats['many']:.2f} "
                  f"medium {stats['medium']:.2f} few {stats['few']:.2f}", flush=True)
            for k, v in stats.items():
                writer.add_scalar(f"test/{k}", v, epoch)
            os.makedirs(args.out, exist_ok=True)
            torch.save({"state_dict": model.module.state_dict(), "epoch": epoch},
                       os.path.join(args.out, "crt_last.pth"))

    if writer is not None:
        writer.close()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
