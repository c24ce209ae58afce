"""Curriculum Labeling (Cascante-Bonilla et al., AAAI'21) on CIFAR-10.

Round 0 trains on the labelled images only. After each round the model labels the whole
unlabelled pool, the top (100 * r / R)% most confident predictions are admitted, and the
model is re-initialised and trained on labelled + admitted pseudo-labelled images.

    torchrun --nproc_per_node=4 19_curriculum_pseudo_labeling.py --work-dir /shared/work/cl_4000
"""
import argparse
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import ConcatDataset, DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler
from torchvision import datasets, transforms
from torchvision.models import resnet18


def arguments():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", default="/shared/datasets/cifar10")
    ap.add_argument("--work-dir", default="/shared/work/cl")
    ap.add_argument("--num-labeled", type=int, default=4000)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--epochs-per-round", type=int, default=120)
    ap.add_argument("--batch-size", type=int, default=128)
    ap.add_argument("--lr", type=float, default=0.1)
    ap.add_argument("--wd", type=float, default=5e-4)
    ap.add_argument("--workers", type=int, default=6)
    return ap.parse_args()


MEAN, STD = (0.4914, 0.4822, 0.4465), (0.2471, 0.2435, 0.2616)
TRAIN_TF = transforms.Compose([transforms.RandomCrop(32, 4, padding_mode="reflect"), transforms.RandomHorizontalFlip(),
                               transforms.RandAugment(2, 9), transforms.ToTensor(), transforms.Normalize(MEAN, STD)])
TEST_TF = transforms.Compose([transforms.ToTensor(), transforms.Normalize(MEAN, STD)])


class Relabeled(Dataset):
    def __init__(self, base, indices, labels):
        self.base, self.indices, self.labels = base, indices, labels

    def __len__(self):
        return len(self.indices)

    def __getitem__(self, i):
        img, _ = self.base[int(self.indices[i])]
        return img, int(self.labels[i])


def fresh_model(device):
    # same seed on every rank -> identical initial weights
    torch.manual_seed(0)
    m = resnet18(num_classes=10)
    m.conv1 = nn.Conv2d(3, 64, 3, 1, 1, bias=False)
    m.maxpool = nn.Identity()
    return m.to(device)


@torch.no_grad()
def label_pool(model, pool, device, batch_size=1024):
    model.eval()
    loader = DataLoader(pool, batch_size=batch_size, shuffle=False, num_workers=8, pin_memory=True)
    confs, preds = [], []
    for x, _ in loader:
        p = model(x.to(device, non_blocking=True)).softmax(1)
        c, y = p.max(1)
        confs.append(c.cpu())
        preds.append(y.cpu())
    return torch.cat(confs), torch.cat(preds)


def train_round(model, loader, sampler, test_loader, epochs, args, device, rank, tag):
    ddp = DDP(model, device_ids=[device.index])
    opt = torch.optim.SGD(ddp.parameters(), lr=args.lr, momentum=0.9, weight_decay=args.wd, nesterov=True)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=args.lr, total_steps=epochs * len(loader))
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        ddp.train()
        t0 = time.time()
        run_loss = torch.zeros(2, device=device)
        for x, y in loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            loss = F.cross_entropy(ddp(x), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            run_loss += torch.stack([loss.detach() * y.numel(), torch.tensor(float(y.numel()), device=device)])
        if (epoch + 1) % 10 == 0 or epoch == epochs - 1:
            ddp.eval()
            hits = torch.zeros(2, device=device)
            with torch.no_grad():
                for x, y in test_loader:
                    hits[0] += (ddp(x.to(device)).argmax(1) == y.to(device)).sum()
                    hits[1] += y.numel()
            dist.all_reduce(hits)
            dist.all_reduce(run_loss)
            if rank == 0:
                print(f"[{tag}] epoch {epoch + 1}/{epochs} loss {(run_loss[0] / run_loss[1]).item():.4f} "
                      f"test {100 * (hits[0] / hits[1]).item():.2f} ({time.time() - t0:.0f}s/ep)", flush=True)
    return ddp.module


def main():
    args = arguments()
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)

    train_aug = datasets.CIFAR10(args.data, train=True, transform=TRAIN_TF)
    train_eval = datasets.CIFAR10(args.data, train=True, transform=TEST_TF)
    test = datasets.CIFAR10(args.data, train=False, transform=TEST_TF)
    targets = np.asarray(train_aug.targets)
    rng = np.random.RandomState(1)
    lab_idx = np.concatenate([rng.choice(np.flatnonzero(targets == c), args.num_labeled // 10, replace=False)
                              for c in range(10)])
    unl_idx = np.setdiff1d(np.arange(len(targets)), lab_idx)
    labeled = Subset(train_aug, lab_idx)
    pool = Subset(train_eval, unl_idx)
    test_loader = DataLoader(test, 500, sampler=DistributedSampler(test, shuffle=False), num_workers=4)
    pl_path = os.path.join(args.work_dir, "pseudo_labels.pt")
    if rank == 0:
        os.makedirs(args.work_dir, exist_ok=True)

    model = None
    for rnd in range(args.rounds + 1):
        if rnd == 0:
            train_set = labeled
        else:
            if rank == 0:
                conf, pred = label_pool(model, pool, device)
                pct = 100.0 * rnd / args.rounds
                cut = np.percentile(conf.numpy(), 100.0 - pct)
                admit = (conf >= cut).nonzero(as_tuple=True)[0].numpy()
                acc = (pred[admit].numpy() == targets[unl_idx[admit]]).mean()
                print(f"round {rnd}: admitting {len(admit)} pseudo-labels (top {pct:.0f}%), "
                      f"precision {acc:.4f}", flush=True)
                torch.save({"round": rnd, "indices": unl_idx[admit], "labels": pred[admit].numpy()}, pl_path)
            pl = torch.load(pl_path, weights_only=False)
            train_set = ConcatDataset([labeled, Relabeled(train_aug, pl["indices"], pl["labels"])])

        sampler = DistributedSampler(train_set, shuffle=True, drop_last=True)
        loader = DataLoader(train_set, args.batch_size, sampler=sampler, num_workers=args.workers,
                            pin_memory=True, drop_last=True, persistent_workers=False)
        # curriculum labelling restarts from scratch every round to avoid confirmation bias
        model = fresh_model(device)
        model = train_round(model, loader, sampler, test_loader, args.epochs_per_round, args, device, rank,
                            tag=f"round {rnd}")
        if rank == 0:
            torch.save(model.state_dict(), os.path.join(args.work_dir, f"model_round{rnd}.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
