"""FixMatch + distribution alignment (ReMixMatch-style) on CIFAR-100, 2500 labels.

usage:
    torchrun --nproc_per_node=4 08_fixmatch_da_cifar100.py --num-labels 2500 --save-dir saved/fmda_2500
"""
import argparse
import math
import os
import random

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torchvision import datasets, transforms
from torchvision.models import resnet18

MEAN = (0.5071, 0.4867, 0.4408)
STD = (0.2675, 0.2565, 0.2761)


def set_seed(seed):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    torch.cuda.manual_seed(seed)


def sample_labeled_data(targets, num_labels, num_classes):
    """Balanced labelled subset; everything is kept as unlabelled data."""
    targets = np.array(targets)
    lb_idx = []
    for c in range(num_classes):
        idx = np.where(targets == c)[0]
        lb_idx.extend(np.random.choice(idx, num_labels // num_classes, replace=False))
    return np.array(lb_idx), np.arange(len(targets))


class BasicSSL(Dataset):
    def __init__(self, data, targets, weak, strong=None):
        self.data, self.targets = data, targets
        self.weak, self.strong = weak, strong

    def __len__(self):
        return len(self.data)

    def __getitem__(self, idx):
        from PIL import Image
        img = Image.fromarray(self.data[idx])
        if self.strong is None:
            return self.weak(img), int(self.targets[idx])
        return self.weak(img), self.strong(img)


def cifar_resnet18(num_classes):
    net = resnet18(num_classes=num_classes)
    net.conv1 = nn.Conv2d(3, 64, kernel_size=3, stride=1, padding=1, bias=False)
    net.maxpool = nn.Identity()
    return net


class DistAlign:
    """Keeps a running mean of the model's predictions on unlabelled data across all GPUs."""

    def __init__(self, num_classes, device, momentum=0.999):
        self.p_model = torch.ones(num_classes, device=device) / num_classes
        self.p_target = torch.ones(num_classes, device=device) / num_classes
        self.m = momentum

    @torch.no_grad()
    def __call__(self, probs):
        batch_mean = probs.mean(0)
        dist.all_reduce(batch_mean)
        batch_mean /= dist.get_world_size()
        self.p_model = self.m * self.p_model + (1 - self.m) * batch_mean
        probs = probs * self.p_target / self.p_model
        return probs / probs.sum(dim=1, keepdim=True)


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data-dir", default="./data")
    ap.add_argument("--save-dir", default="saved/fmda")
    ap.add_argument("--num-labels", type=int, default=2500)
    ap.add_argument("--num-train-iter", type=int, default=500_000)
    ap.add_argument("--num-eval-iter", type=int, default=5000)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--uratio", type=int, default=7)
    ap.add_argument("--lr", type=float, default=0.03)
    ap.add_argument("--weight-decay", type=float, default=1e-3)
    ap.add_argument("--p-cutoff", type=float, default=0.95)
    ap.add_argument("--seed", type=int, default=0)
    return ap.parse_args()


def main():
    args = get_args()
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    # different augmentation streams per process
    set_seed(args.seed + rank)

    train = datasets.CIFAR100(args.data_dir, train=True, download=False)
    lb_idx, ulb_idx = sample_labeled_data(train.targets, args.num_labels, 100)
    targets = np.array(train.targets)

    weak = transforms.Compose([transforms.RandomHorizontalFlip(), transforms.RandomCrop(32, 4, padding_mode="reflect"),
                               transforms.ToTensor(), transforms.Normalize(MEAN, STD)])
    strong = transforms.Compose([transforms.RandomHorizontalFlip(), transforms.RandomCrop(32, 4, padding_mode="reflect"),
                                 transforms.RandAugment(3, 10), transforms.ToTensor(), transforms.Normalize(MEAN, STD)])
    lb_dset = BasicSSL(train.data[lb_idx], targets[lb_idx], weak)
    ulb_dset = BasicSSL(train.data[ulb_idx], targets[ulb_idx], weak, strong)
    test_dset = datasets.CIFAR100(args.data_dir, train=False,
                                  transform=transforms.Compose([transforms.ToTensor(), transforms.Normalize(MEAN, STD)]))

    lb_sampler = DistributedSampler(lb_dset, shuffle=True, seed=args.seed)
    ulb_sampler = DistributedSampler(ulb_dset, shuffle=True, seed=args.seed)
    lb_loader = DataLoader(lb_dset, args.batch_size, sampler=lb_sampler, num_workers=2, drop_last=True, pin_memory=True)
    ulb_loader = DataLoader(ulb_dset, args.batch_size * args.uratio, sampler=ulb_sampler, num_workers=6,
                            drop_last=True, pin_memory=True)
    test_loader = DataLoader(test_dset, 500, sampler=DistributedSampler(test_dset, shuffle=False), num_workers=2)

    model = cifar_resnet18(100).to(device)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    model = DDP(model, device_ids=[local_rank])
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9, weight_decay=args.weight_decay, nesterov=True)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda it: math.cos(7 * math.pi * it / (16 * args.num_train_iter)))
    dist_align = DistAlign(100, device)

    if rank == 0:
        os.makedirs(args.save_dir, exist_ok=True)
        np.save(os.path.join(args.save_dir, "lb_idx.npy"), lb_idx)

    def forever(loader, sampler):
        ep = 0
        while True:
            sampler.set_epoch(ep)
            for batch in loader:
                yield batch
            ep += 1

    lb_iter, ulb_iter = forever(lb_loader, lb_sampler), forever(ulb_loader, ulb_sampler)
    best_acc, it = 0.0, 0
    model.train()
    while it < args.num_train_iter:
        x_lb, y_lb = next(lb_iter)
        x_w, x_s = next(ulb_iter)
        n_lb = x_lb.size(0)
        inputs = torch.cat([x_lb, x_w, x_s]).to(device, non_blocking=True)
        y_lb = y_lb.to(device, non_blocking=True)

        logits = model(inputs)
        logits_lb = logits[:n_lb]
        logits_w, logits_s = logits[n_lb:].chunk(2)
        sup_loss = F.cross_entropy(logits_lb, y_lb)

        probs = dist_align(logits_w.detach().softmax(-1))
        max_probs, pseudo = probs.max(-1)
        mask = max_probs.ge(args.p_cutoff).float()
        unsup_loss = (F.cross_entropy(logits_s, pseudo, reduction="none") * mask).mean()
        loss = sup_loss + unsup_loss

        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        scheduler.step()
        it += 1

        if rank == 0 and it % 250 == 0:
            print(f"[{it}] sup {sup_loss.item():.4f} unsup {unsup_loss.item():.4f} "
                  f"mask {mask.mean().item():.3f} lr {scheduler.get_last_lr()[0]:.5f}", flush=True)

        if it % args.num_eval_iter == 0:
            model.eval()
            res = torch.zeros(3, device=device)
            with torch.no_grad():
                for x, y in test_loader:
                    x, y = x.to(device), y.to(device)
                    out = model(x)
                    res[0] += F.cross_entropy(out, y, reduction="sum")
                    res[1] += (out.argmax(1) == y).sum()
                    res[2] += y.size(0)
            dist.all_reduce(res)
            acc = (res[1] / res[2]).item()
            if rank == 0:
                print(f"[{it}] eval loss {(res[0] / res[2]).item():.4f} top1 {acc:.4f}", flush=True)
                state = {"it": it, "model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                         "scheduler": scheduler.state_dict(), "p_model": dist_align.p_model.cpu()}
                torch.save(state, os.path.join(args.save_dir, "latest_model.pth"))
                if acc > best_acc:
                    best_acc = acc
                    torch.save(state, os.path.join(args.save_dir, "model_best.pth"))
            model.train()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
