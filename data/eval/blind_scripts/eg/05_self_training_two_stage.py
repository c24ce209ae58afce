"""Two-stage self-training (teacher -> hard pseudo-labels -> noised student) on SVHN.

stage "teacher": supervised training on the labelled subset only.
stage "student": the trained teacher labels the unlabelled pool (train + extra);
                 confident pseudo-labels are mixed with the labelled data and a
                 student is trained from scratch with strong augmentation.

    torchrun --nproc_per_node=8 05_self_training_two_stage.py --stage teacher --out exp/st
    torchrun --nproc_per_node=8 05_self_training_two_stage.py --stage student --out exp/st
"""
import argparse
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchvision
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import ConcatDataset, DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler
from torchvision import transforms as T

MEAN, STD = (0.4377, 0.4438, 0.4728), (0.1980, 0.2010, 0.1970)


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--stage", choices=["teacher", "student"], required=True)
    ap.add_argument("--data", default="/scratch/datasets/svhn")
    ap.add_argument("--out", default="exp/self_training_svhn")
    ap.add_argument("--n-labels", type=int, default=1000)
    ap.add_argument("--batch-size", type=int, default=64, help="per GPU; global 512 on 8 GPUs")
    ap.add_argument("--epochs", type=int, default=100)
    ap.add_argument("--lr", type=float, default=0.2, help="for the global batch of 512")
    ap.add_argument("--repeat", type=int, default=40, help="passes over the labelled set per teacher epoch")
    ap.add_argument("--wd", type=float, default=5e-4)
    ap.add_argument("--conf", type=float, default=0.9)
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--resume", action="store_true")
    return ap.parse_args()


def make_net(num_classes=10, dropout=0.0):
    net = torchvision.models.resnet18(num_classes=num_classes)
    net.conv1 = nn.Conv2d(3, 64, 3, 1, 1, bias=False)
    net.maxpool = nn.Identity()
    if dropout > 0:
        net.fc = nn.Sequential(nn.Dropout(dropout), nn.Linear(512, num_classes))
    return net


class PseudoLabelled(Dataset):
    def __init__(self, base, indices, labels, transform):
        self.base, self.indices, self.labels, self.transform = base, indices, labels, transform

    def __len__(self):
        return len(self.indices)

    def __getitem__(self, i):
        img, _ = self.base[self.indices[i]]
        return self.transform(img), int(self.labels[i])


class Relabel(Dataset):
    def __init__(self, base, transform):
        self.base, self.transform = base, transform

    def __len__(self):
        return len(self.base)

    def __getitem__(self, i):
        img, y = self.base[i]
        return self.transform(img), int(y)


def save_ckpt(path, model, optimizer, epoch, acc):
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                "epoch": epoch, "acc": acc}, path)


@torch.no_grad()
def accuracy(model, loader, device):
    model.eval()
    c = torch.zeros(2, device=device)
    for x, y in loader:
        x, y = x.to(device), y.to(device)
        c[0] += (model(x).argmax(1) == y).sum()
        c[1] += y.numel()
    dist.all_reduce(c)
    return (100 * c[0] / c[1]).item()


@torch.no_grad()
def pseudo_label(teacher, pool, device, rank, world, batch_size=1024):
    """Every rank labels a strided share of the pool; results are gathered on all ranks."""
    teacher.eval()
    tf = T.Compose([T.ToTensor(), T.Normalize(MEAN, STD)])
    my_idx = list(range(rank, len(pool), world))
    loader = DataLoader(Subset(Relabel(pool, tf), my_idx), batch_size=batch_size, num_workers=8)
    probs = []
    for x, _ in loader:
        probs.append(F.softmax(teacher(x.to(device)), 1).cpu())
    probs = torch.cat(probs)
    conf, lab = probs.max(1)
    mine = (my_idx, lab.tolist(), conf.tolist())
    gathered = [None] * world
    dist.all_gather_object(gathered, mine)
    idx = np.concatenate([g[0] for g in gathered])
    lab = np.concatenate([g[1] for g in gathered])
    conf = np.concatenate([g[2] for g in gathered])
    order = np.argsort(idx)
    return idx[order], lab[order], conf[order]


def train(args, model, loader, sampler, test_loader, device, rank, tag, start_epoch=0, optimizer=None):
    if optimizer is None:
        optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9,
                                    weight_decay=args.wd, nesterov=True)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, args.epochs * len(loader))
    for _ in range(start_epoch * len(loader)):
        sched.step()
    best = 0.0
    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for x, y in loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            loss = F.cross_entropy(model(x), y, label_smoothing=0.1 if tag == "student" else 0.0)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            sched.step()
        acc = accuracy(model.module, test_loader, device)
        if rank == 0:
            print(f"[{tag}] epoch {epoch} loss {loss.item():.4f} acc {acc:.2f} ({time.time() - t0:.0f}s)",
                  flush=True)
            save_ckpt(os.path.join(args.out, f"{tag}_last.pt"), model, optimizer, epoch + 1, acc)
            if acc > best:
                best = acc
                save_ckpt(os.path.join(args.out, f"{tag}_best.pt"), model, optimizer, epoch + 1, acc)
        dist.barrier()
    return best


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(args.seed)
    os.makedirs(args.out, exist_ok=True)

    if rank == 0:
        for split in ("train", "extra", "test"):
            torchvision.datasets.SVHN(args.data, split=split, download=True)
    dist.barrier()

    svhn_train = torchvision.datasets.SVHN(args.data, split="train")
    svhn_extra = torchvision.datasets.SVHN(args.data, split="extra")
    test_tf = T.Compose([T.ToTensor(), T.Normalize(MEAN, STD)])
    test_set = torchvision.datasets.SVHN(args.data, split="test", transform=test_tf)
    test_loader = DataLoader(Subset(test_set, list(range(rank, len(test_set), world))),
                             batch_size=1024, num_workers=4)

    rng = np.random.RandomState(args.seed)
    labels = np.asarray(svhn_train.labels)
    lab_idx = np.concatenate([rng.choice(np.flatnonzero(labels == c), args.n_labels // 10, replace=False)
                              for c in range(10)])
    weak = T.Compose([T.RandomCrop(32, padding=2), T.ToTensor(), T.Normalize(MEAN, STD)])
    strong = T.Compose([T.RandomCrop(32, padding=2), T.RandAugment(2, 10), T.ToTensor(),
                        T.Normalize(MEAN, STD), T.RandomErasing(p=0.5)])

    if args.stage == "teacher":
        train_set = Relabel(Subset(svhn_train, np.tile(lab_idx, args.repeat)), weak)
        model = make_net().to(device)
    else:
        teacher = make_net().to(device)
        ckpt = torch.load(os.path.join(args.out, "teacher_best.pt"), map_location="cpu")
        teacher.load_state_dict(ckpt["model"])
        pool = ConcatDataset([svhn_train, svhn_extra])
        idx, pl, conf = pseudo_label(teacher, pool, device, rank, world)
        keep = conf >= args.conf
        if rank == 0:
            print(f"teacher acc {ckpt['acc']:.2f}: kept {keep.sum()}/{len(keep)} pseudo-labels", flush=True)
        del teacher
        train_set = ConcatDataset([
            Relabel(Subset(svhn_train, lab_idx), strong),
            PseudoLabelled(pool, idx[keep], pl[keep], strong),
        ])
        model = make_net(dropout=0.3).to(device)

    sampler = DistributedSampler(train_set, shuffle=True, seed=args.seed, drop_last=True)
    loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler,
                        num_workers=args.workers, pin_memory=True, drop_last=True,
                        persistent_workers=True)
    model = DistributedDataParallel(model, device_ids=[local_rank])

    optimizer, start_epoch = None, 0
    last = os.path.join(args.out, f"{args.stage}_last.pt")
    if args.resume and os.path.exists(last):
        ckpt = torch.load(last, map_location="cpu")
        model.load_state_dict(ckpt["model"])
        optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9,
                                    weight_decay=args.wd, nesterov=True)
        optimizer.load_state_dict(ckpt["optimizer"])
        start_epoch = ckpt["epoch"]

    best = train(args, model, loader, sampler, test_loader, device, rank, args.stage, start_epoch, optimizer)
    if rank == 0:
        print(f"[{args.stage}] best test acc {best:.2f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
