"""UDA (Xie et al., 2020) on CIFAR-10 with training-signal annealing.

Evaluation protocol of Oliver et al. (2018): 5000 training images are held out as a
validation set for model selection; the labelled set is drawn from the rest and
the unlabelled set is the rest without labels.

    torchrun --nproc_per_node=4 11_uda_tsa_cifar10.py --n-labeled 4000 --tsa linear
"""
import argparse
import logging
import math
import os
import random
import time
from copy import deepcopy

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Subset
from torch.utils.data.distributed import DistributedSampler
from torchvision import datasets, transforms

from nets.wrn import WRN28_2
from augment.autoaugment import CIFAR10Policy, Cutout

MEAN, STD = (0.4914, 0.4822, 0.4465), (0.2471, 0.2435, 0.2616)
log = logging.getLogger("uda")


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data", default="./data")
    p.add_argument("--out", default="./runs/uda")
    p.add_argument("--n-labeled", type=int, default=4000)
    p.add_argument("--n-val", type=int, default=5000)
    p.add_argument("--lbs", type=int, default=16, help="labelled per GPU")
    p.add_argument("--ubs", type=int, default=112, help="unlabelled per GPU")
    p.add_argument("--steps", type=int, default=400_000)
    p.add_argument("--eval-every", type=int, default=2000)
    p.add_argument("--lr", type=float, default=0.03)
    p.add_argument("--wd", type=float, default=5e-4)
    p.add_argument("--warmup", type=int, default=20_000)
    p.add_argument("--tsa", default="linear", choices=["none", "linear", "log", "exp"])
    p.add_argument("--uda-T", type=float, default=0.4)
    p.add_argument("--uda-conf", type=float, default=0.8)
    p.add_argument("--uda-coeff", type=float, default=1.0)
    p.add_argument("--ema", type=float, default=0.9999)
    p.add_argument("--seed", type=int, default=42)
    return p.parse_args()


def set_seed(seed):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def tsa_threshold(schedule, step, total, num_classes):
    t = step / total
    if schedule == "linear":
        alpha = t
    elif schedule == "log":
        alpha = 1 - math.exp(-t * 5)
    elif schedule == "exp":
        alpha = math.exp((t - 1) * 5)
    else:
        return 1.0
    return alpha * (1 - 1 / num_classes) + 1 / num_classes


class UDAPair:
    def __init__(self):
        self.orig = transforms.Compose([transforms.RandomCrop(32, padding=4, padding_mode="reflect"),
                                        transforms.RandomHorizontalFlip(), transforms.ToTensor(),
                                        transforms.Normalize(MEAN, STD)])
        self.aug = transforms.Compose([transforms.RandomCrop(32, padding=4, padding_mode="reflect"),
                                       transforms.RandomHorizontalFlip(), CIFAR10Policy(),
                                       transforms.ToTensor(), transforms.Normalize(MEAN, STD),
                                       Cutout(n_holes=1, length=16)])

    def __call__(self, img):
        return self.orig(img), self.aug(img)


def make_splits(targets, n_labeled, n_val, num_classes=10):
    targets = np.asarray(targets)
    perm = np.random.permutation(len(targets))
    val_idx, rest = perm[:n_val], perm[n_val:]
    lab_idx = []
    for c in range(num_classes):
        cls = rest[targets[rest] == c]
        lab_idx.extend(cls[: n_labeled // num_classes].tolist())
    unl_idx = rest
    return np.array(lab_idx), unl_idx, val_idx


def forever(loader, sampler):
    epoch = 0
    while True:
        sampler.set_epoch(epoch)
        for b in loader:
            yield b
        epoch += 1


@torch.no_grad()
def accuracy(net, loader, device):
    net.eval()
    good = torch.zeros((), device=device)
    seen = torch.zeros((), device=device)
    for x, y in loader:
        x, y = x.to(device), y.to(device)
        good += (net(x).argmax(1) == y).sum()
        seen += y.numel()
    dist.all_reduce(good)
    dist.all_reduce(seen)
    return (100 * good / seen).item()


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.ERROR,
                        format="%(asctime)s %(message)s")
    # per-rank seed so that augmentations and dropout differ between GPUs
    set_seed(args.seed + rank)

    if rank == 0:
        datasets.CIFAR10(args.data, train=True, download=True)
        datasets.CIFAR10(args.data, train=False, download=True)
    dist.barrier()

    lab_tf = transforms.Compose([transforms.RandomCrop(32, padding=4, padding_mode="reflect"),
                                 transforms.RandomHorizontalFlip(), transforms.ToTensor(),
                                 transforms.Normalize(MEAN, STD)])
    plain_tf = transforms.Compose([transforms.ToTensor(), transforms.Normalize(MEAN, STD)])
    base_lab = datasets.CIFAR10(args.data, train=True, transform=lab_tf)
    base_unl = datasets.CIFAR10(args.data, train=True, transform=UDAPair())
    base_val = datasets.CIFAR10(args.data, train=True, transform=plain_tf)
    test_set = datasets.CIFAR10(args.data, train=False, transform=plain_tf)

    lab_idx, unl_idx, val_idx = make_splits(base_lab.targets, args.n_labeled, args.n_val)
    lab_set, unl_set = Subset(base_lab, lab_idx), Subset(base_unl, unl_idx)
    val_set = Subset(base_val, val_idx[rank::world])
    test_shard = Subset(test_set, list(range(rank, len(test_set), world)))

    lab_sampler = DistributedSampler(lab_set, drop_last=True)
    unl_sampler = DistributedSampler(unl_set, drop_last=True)
    lab_loader = DataLoader(lab_set, args.lbs, sampler=lab_sampler, num_workers=4, pin_memory=True, drop_last=True)
    unl_loader = DataLoader(unl_set, args.ubs, sampler=unl_sampler, num_workers=8, pin_memory=True, drop_last=True)
    val_loader = DataLoader(val_set, 500, num_workers=4)
    test_loader = DataLoader(test_shard, 500, num_workers=4)

    model = WRN28_2(num_classes=10).to(device)
    model = DDP(model, device_ids=[local_rank])
    ema_model = deepcopy(model.module).eval()  # copied after DDP has broadcast rank 0's weights
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9, nesterov=True, weight_decay=args.wd)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: s / args.warmup if s < args.warmup
        else 0.5 * (1 + math.cos(math.pi * (s - args.warmup) / (args.steps - args.warmup))))

    lab_stream, unl_stream = forever(lab_loader, lab_sampler), forever(unl_loader, unl_sampler)
    best_val, test_at_best = 0.0, 0.0
    os.makedirs(args.out, exist_ok=True)
    model.train()
    t0 = time.time()
    for step in range(1, args.steps + 1):
        x, y = next(lab_stream)
        (u_orig, u_aug), _ = next(unl_stream)
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        u_orig, u_aug = u_orig.to(device, non_blocking=True), u_aug.to(device, non_blocking=True)

        logits = model(torch.cat([x, u_orig, u_aug]))
        logits_x = logits[: x.size(0)]
        logits_orig, logits_aug = logits[x.size(0):].chunk(2)

        # training-signal annealing: drop labelled examples the model is already sure about
        thr = tsa_threshold(args.tsa, step, args.steps, 10)
        sup = F.cross_entropy(logits_x, y, reduction="none")
        p_true = torch.softmax(logits_x, 1).gather(1, y[:, None]).squeeze(1).detach()
        tsa_mask = (p_true < thr).float()
        sup_loss = (sup * tsa_mask).sum() / tsa_mask.sum().clamp(min=1.0)

        with torch.no_grad():
            p_orig = torch.softmax(logits_orig, 1)
            target = torch.softmax(logits_orig / args.uda_T, 1)
            conf_mask = (p_orig.max(1).values > args.uda_conf).float()
        kl = F.kl_div(F.log_softmax(logits_aug, 1), target, reduction="none").sum(1)
        unsup_loss = (kl * conf_mask).mean()
        loss = sup_loss + args.uda_coeff * unsup_loss

        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        scheduler.step()
        with torch.no_grad():
            for pe, pm in zip(ema_model.parameters(), model.module.parameters()):
                pe.mul_(args.ema).add_(pm, alpha=1 - args.ema)
            for be, bm in zip(ema_model.buffers(), model.module.buffers()):
                be.copy_(bm)

        if step % 100 == 0:
            log.info("step %d sup %.4f unsup %.4f tsa %.3f conf %.3f %.3fs/it", step, sup_loss.item(),
                     unsup_loss.item(), thr, conf_mask.mean().item(), (time.time() - t0) / 100)
            t0 = time.time()

        if step % args.eval_every == 0:
            val_acc = accuracy(ema_model, val_loader, device)
            test_acc = accuracy(ema_model, test_loader, device)
            if val_acc > best_val:
                best_val, test_at_best = val_acc, test_acc
                if rank == 0:
                    torch.save({"ema": ema_model.state_dict(), "step": step, "val": val_acc, "test": test_acc},
                               os.path.join(args.out, "best_ema.pt"))
            if rank == 0:
                torch.save({"model": model.module.state_dict(), "ema": ema_model.state_dict(),
                            "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(),
                            "step": step}, os.path.join(args.out, "last.pt"))
            log.info("[eval] step %d val %.2f test %.2f | best val %.2f (test %.2f)",
                     step, val_acc, test_acc, best_val, test_at_best)
            model.train()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
