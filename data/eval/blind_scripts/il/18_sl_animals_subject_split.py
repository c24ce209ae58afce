"""SL-Animals-DVS (19 animal signs) with a spiking CNN, subject-wise split.

Recordings were converted to <root>/events/<subject>_<scene>.npy (x, y, t, p) with
the sign boundaries in <root>/tags/<subject>_<scene>.csv. Whole subjects are
held out for testing so that no signer appears on both sides.

Voxelised slices are cached once under --cache (rank 0 builds, the others wait).

    torchrun --nproc_per_node=4 18_sl_animals_subject_split.py --root /data/sl_animals --cache /scratch/sl_animals_T16
"""
import argparse
import csv
import glob
import os
import random

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import wandb
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

from spikingjelly.activation_based import functional, layer, neuron, surrogate

NUM_CLASSES = 19


def subject_of(path):
    return os.path.basename(path).split("_")[0]


def build_cache(root, cache_dir, T):
    os.makedirs(cache_dir, exist_ok=True)
    for rec in sorted(glob.glob(os.path.join(root, "events", "*.npy"))):
        name = os.path.splitext(os.path.basename(rec))[0]
        out = os.path.join(cache_dir, name + ".npz")
        if os.path.exists(out):
            continue
        ev = np.load(rec)
        slices, labels = [], []
        with open(os.path.join(root, "tags", name + ".csv")) as f:
            for row in csv.reader(f):
                label, t0, t1 = int(row[0]), int(row[1]), int(row[2])
                m = (ev["t"] >= t0) & (ev["t"] < t1)
                x, y, t, p = ev["x"][m], ev["y"][m], ev["t"][m], ev["p"][m]
                tb = np.clip((t - t0) * T // max(t1 - t0, 1), 0, T - 1).astype(np.int64)
                vox = np.zeros((T, 2, 128, 128), np.uint8)
                np.add.at(vox, (tb, p.astype(np.int64), y.astype(np.int64), x.astype(np.int64)), 1)
                slices.append(vox)
                labels.append(label)
        tmp = out + f".tmp{os.getpid()}.npz"
        np.savez(tmp, voxels=np.stack(slices), labels=np.asarray(labels))
        os.replace(tmp, out)


class AnimalSlices(Dataset):
    def __init__(self, cache_dir, recordings, train):
        self.items = []
        for name in recordings:
            d = np.load(os.path.join(cache_dir, name + ".npz"))
            self.items += [(v, int(l)) for v, l in zip(d["voxels"], d["labels"])]
        self.train = train

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        vox, label = self.items[i]
        x = torch.from_numpy(vox.astype(np.float32)).clamp_(max=4) / 4
        if self.train:
            x = torch.roll(x, shifts=tuple(np.random.randint(-8, 9, size=2).tolist()), dims=(2, 3))
        return x, label, i


def conv_sn(cin, cout):
    return nn.Sequential(
        layer.SeqToANNContainer(nn.Conv2d(cin, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout)),
        neuron.ParametricLIFNode(surrogate_function=surrogate.ATan(), detach_reset=True, step_mode="m"),
        layer.SeqToANNContainer(nn.MaxPool2d(2)),
    )


class AnimalSNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.features = nn.Sequential(conv_sn(2, 64), conv_sn(64, 128), conv_sn(128, 128), conv_sn(128, 256),
                                      conv_sn(256, 256))
        self.classifier = layer.SeqToANNContainer(nn.Flatten(), nn.Dropout(0.5), nn.Linear(256 * 4 * 4, NUM_CLASSES))

    def forward(self, x):  # [B, T, 2, 128, 128]
        return self.classifier(self.features(x.transpose(0, 1))).mean(0)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", required=True)
    ap.add_argument("--cache", required=True)
    ap.add_argument("--out", default="checkpoints/sl_animals")
    ap.add_argument("--T", type=int, default=16)
    ap.add_argument("--test-subjects", type=int, default=12)
    ap.add_argument("--split-seed", type=int, default=0)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--epochs", type=int, default=120)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--project", default="sl-animals-snn")
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    if rank == 0:
        build_cache(args.root, args.cache, args.T)
    dist.barrier()

    # subject split from its own RNG: identical on every rank, independent of the training seed
    names = sorted(os.path.splitext(os.path.basename(p))[0] for p in glob.glob(os.path.join(args.cache, "*.npz")))
    subjects = sorted({subject_of(n) for n in names})
    random.Random(args.split_seed).shuffle(subjects)
    test_subjects = set(subjects[:args.test_subjects])
    train_recs = [n for n in names if subject_of(n) not in test_subjects]
    test_recs = [n for n in names if subject_of(n) in test_subjects]

    # per-rank seed only drives augmentation / dropout; DDP broadcasts rank 0's initial weights
    random.seed(args.seed + rank)
    np.random.seed(args.seed + rank)
    torch.manual_seed(args.seed + rank)

    train_set = AnimalSlices(args.cache, train_recs, train=True)
    test_set = AnimalSlices(args.cache, test_recs, train=False)
    train_sampler = DistributedSampler(train_set, shuffle=True, seed=args.seed, drop_last=True)
    test_sampler = DistributedSampler(test_set, shuffle=False)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=args.workers, pin_memory=True, drop_last=True)
    test_loader = DataLoader(test_set, batch_size=args.batch_size, sampler=test_sampler,
                             num_workers=args.workers, pin_memory=True)

    model = nn.SyncBatchNorm.convert_sync_batchnorm(AnimalSNN()).to(device)
    model = DDP(model, device_ids=[local_rank])
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, args.epochs)

    run = None
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        run = wandb.init(project=args.project, config={**vars(args), "world_size": world,
                                                       "test_subjects": sorted(test_subjects)})

    best = 0.0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        stats = torch.zeros(3, device=device)
        for x, y, _ in train_loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            out = model(x)
            loss = F.cross_entropy(out, y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            functional.reset_net(model)
            stats += torch.stack([loss.detach() * y.numel(), (out.argmax(1) == y).sum().float(),
                                  torch.tensor(float(y.numel()), device=device)])
        scheduler.step()
        dist.all_reduce(stats)

        # padded samples of the DistributedSampler are dropped by de-duplicating on the dataset index
        model.eval()
        local = {}
        with torch.no_grad():
            for x, y, idx in test_loader:
                pred = model.module(x.to(device)).argmax(1).cpu()
                functional.reset_net(model)
                local.update({int(i): int(p == t) for i, p, t in zip(idx, pred, y)})
        gathered = [None] * world
        dist.all_gather_object(gathered, local)

        if rank == 0:
            merged = {}
            for part in gathered:
                merged.update(part)
            test_acc = sum(merged.values()) / len(merged)
            best = max(best, test_acc)
            run.log({"train/loss": (stats[0] / stats[2]).item(), "train/acc": (stats[1] / stats[2]).item(),
                     "test/acc": test_acc, "lr": scheduler.get_last_lr()[0]}, step=epoch)
            print(f"epoch {epoch}: test acc {test_acc:.4f} over {len(merged)} slices (best {best:.4f})", flush=True)
            if test_acc >= best:
                torch.save(model.module.state_dict(), os.path.join(args.out, f"best_seed{args.seed}.pt"))

    if rank == 0:
        run.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
