"""Curriculum Labeling (Cascante-Bonilla et al., AAAI 2021), CIFAR-10 / WRN-28-2.

Self-paced pseudo-labelling in rounds: after each round the current model labels
the unlabelled pool; the top-(20 * r)% most confident predictions are added to the
training set and a new model is trained from scratch (re-initialised, not
fine-tuned) on labelled + pseudo-labelled data.

    torchrun --nproc_per_node=4 12_curriculum_labeling.py --num-labeled 4000 --rounds 5
"""
import argparse
import json
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import ConcatDataset, DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler
from torchvision import datasets, transforms

from models import wide_resnet28_2

MEAN, STD = (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", default="/data/cifar10")
    ap.add_argument("--split-dir", default="./splits")
    ap.add_argument("--out", default="./exp/curriculum_labeling")
    ap.add_argument("--num-labeled", type=int, default=4000)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--epochs", type=int, default=400, help="epochs per round")
    ap.add_argument("--batch-size", type=int, default=512, help="global batch")
    ap.add_argument("--lr", type=float, default=0.1)
    ap.add_argument("--wd", type=float, default=5e-4)
    ap.add_argument("--mixup", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--workers", type=int, default=6)
    return ap.parse_args()


class WithLabels(Dataset):
    def __init__(self, base, indices, labels):
        self.base, self.indices, self.labels = base, np.asarray(indices), np.asarray(labels)

    def __len__(self):
        return len(self.indices)

    def __getitem__(self, i):
        x, _ = self.base[int(self.indices[i])]
        return x, int(self.labels[i])


def load_or_create_split(path, targets, num_labeled, seed, rank):
    """Rank 0 draws the split once and writes it; everybody reads the same file."""
    if rank == 0 and not os.path.exists(path):
        rng = np.random.RandomState(seed)
        targets = np.asarray(targets)
        labeled = np.concatenate([rng.choice(np.flatnonzero(targets == c), num_labeled // 10, replace=False)
                                  for c in range(10)])
        unlabeled = np.setdiff1d(np.arange(len(targets)), labeled)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = path + ".tmp"
        with open(tmp, "w") as f:
            json.dump({"labeled": labeled.tolist(), "unlabeled": unlabeled.tolist()}, f)
        os.replace(tmp, path)
    dist.barrier()
    with open(path) as f:
        split = json.load(f)
    return np.array(split["labeled"]), np.array(split["unlabeled"])


@torch.no_grad()
def predict_pool(net, dataset, indices, device, rank, world):
    net.eval()
    mine = indices[rank::world]
    loader = DataLoader(Subset(dataset, mine.tolist()), batch_size=1000, num_workers=4)
    conf, pred = [], []
    for x, _ in loader:
        p = torch.softmax(net(x.to(device)), 1)
        c, l = p.max(1)
        conf.append(c.cpu())
        pred.append(l.cpu())
    local = (mine.tolist(), torch.cat(conf).tolist(), torch.cat(pred).tolist())
    everything = [None] * world
    dist.all_gather_object(everything, local)
    idx = np.concatenate([e[0] for e in everything])
    conf = np.concatenate([e[1] for e in everything])
    pred = np.concatenate([e[2] for e in everything])
    order = np.argsort(idx, kind="stable")
    return idx[order], conf[order], pred[order]


@torch.no_grad()
def evaluate(net, loader, device):
    net.eval()
    s = torch.zeros(2, device=device)
    for x, y in loader:
        x, y = x.to(device), y.to(device)
        s[0] += (net(x).argmax(1) == y).sum()
        s[1] += len(y)
    dist.all_reduce(s)
    return (100 * s[0] / s[1]).item()


def train_round(args, r, train_set, test_loader, device, local_rank, rank, world):
    torch.manual_seed(args.seed + 1000 * r)
    net = wide_resnet28_2(num_classes=10).to(device)
    model = DDP(net, device_ids=[local_rank])
    per_gpu = args.batch_size // world
    sampler = DistributedSampler(train_set, shuffle=True, seed=args.seed + r, drop_last=True)
    loader = DataLoader(train_set, batch_size=per_gpu, sampler=sampler, num_workers=args.workers,
                        pin_memory=True, drop_last=True)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9, nesterov=True,
                                weight_decay=args.wd)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.epochs * len(loader))

    best, best_path = 0.0, os.path.join(args.out, f"round{r}_best.pt")
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for x, y in loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            lam = float(np.random.beta(args.mixup, args.mixup)) if args.mixup > 0 else 1.0
            perm = torch.randperm(x.size(0), device=device)
            out = model(lam * x + (1 - lam) * x[perm])
            loss = lam * F.cross_entropy(out, y) + (1 - lam) * F.cross_entropy(out, y[perm])
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            scheduler.step()
        if epoch % 10 == 9 or epoch == args.epochs - 1:
            acc = evaluate(model.module, test_loader, device)
            if rank == 0:
                print(f"round {r} epoch {epoch} loss {loss.item():.4f} test {acc:.2f} "
                      f"({time.time() - t0:.0f}s/epoch)", flush=True)
                if acc > best:
                    best = acc
                    torch.save(model.module.state_dict(), best_path)
                torch.save({"model": model.module.state_dict(), "epoch": epoch, "round": r},
                           os.path.join(args.out, f"round{r}_last.pt"))
            best = torch.tensor(best if rank == 0 else 0.0, device=device)
            dist.broadcast(best, src=0)
            best = best.item()
    dist.barrier()
    del model
    return best_path, best


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    assert args.batch_size % world == 0
    np.random.seed(args.seed + rank)  # only drives the mixup coefficients
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        datasets.CIFAR10(args.data, train=True, download=True)
        datasets.CIFAR10(args.data, train=False, download=True)
    dist.barrier()

    aug = transforms.Compose([transforms.RandomCrop(32, padding=4, padding_mode="reflect"),
                              transforms.RandomHorizontalFlip(), transforms.ToTensor(),
                              transforms.Normalize(MEAN, STD)])
    plain = transforms.Compose([transforms.ToTensor(), transforms.Normalize(MEAN, STD)])
    train_aug = datasets.CIFAR10(args.data, train=True, transform=aug)
    train_plain = datasets.CIFAR10(args.data, train=True, transform=plain)
    test_set = datasets.CIFAR10(args.data, train=False, transform=plain)
    test_loader = DataLoader(Subset(test_set, list(range(rank, len(test_set), world))), 1000, num_workers=4)

    split_path = os.path.join(args.split_dir, f"cifar10_{args.num_labeled}_seed{args.seed}.json")
    lab_idx, unl_idx = load_or_create_split(split_path, train_aug.targets, args.num_labeled, args.seed, rank)
    lab_targets = np.asarray(train_aug.targets)[lab_idx]
    train_set = WithLabels(train_aug, lab_idx, lab_targets)

    history = []
    for r in range(args.rounds + 1):
        best_path, best = train_round(args, r, train_set, test_loader, device, local_rank, rank, world)
        history.append({"round": r, "train_size": len(train_set), "best_test": best})
        if r == args.rounds:
            break
        teacher = wide_resnet28_2(num_classes=10).to(device)
        teacher.load_state_dict(torch.load(best_path, map_location="cpu"))
        idx, conf, pred = predict_pool(teacher, train_plain, unl_idx, device, rank, world)
        del teacher
        pct = min(100, 20 * (r + 1))
        thr = np.percentile(conf, 100 - pct)
        keep = conf >= thr
        pseudo = WithLabels(train_aug, idx[keep], pred[keep])
        train_set = ConcatDataset([WithLabels(train_aug, lab_idx, lab_targets), pseudo])
        if rank == 0:
            true = np.asarray(train_aug.targets)[idx[keep]]
            print(f"round {r}: added {keep.sum()} pseudo-labels (top {pct}%, thr {thr:.3f}), "
                  f"pseudo-label acc {(true == pred[keep]).mean() * 100:.2f}", flush=True)

    if rank == 0:
        with open(os.path.join(args.out, "history.json"), "w") as f:
            json.dump(history, f, indent=2)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
