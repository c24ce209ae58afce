"""UDA (Unsupervised Data Augmentation, Xie et al. 2020) on CIFAR-10 with 4k labels.

Training signal annealing on the supervised loss, sharpened + confidence-masked
KL consistency between weak and RandAugment views on unlabelled images.

    torchrun --nproc_per_node=4 18_uda_cifar10_wandb.py --wandb-project ssl-cifar --run-name uda-4k
"""
import argparse
import math
import os

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import wandb
from timm.models import create_model
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler
from torchvision import datasets, transforms


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", default="/datasets/cifar10")
    ap.add_argument("--out", default="ckpt/uda_4k")
    ap.add_argument("--wandb-project", default="ssl-cifar")
    ap.add_argument("--run-name", default=None)
    ap.add_argument("--labels", type=int, default=4000)
    ap.add_argument("--steps", type=int, default=400_000)
    ap.add_argument("--eval-interval", type=int, default=2000)
    ap.add_argument("--sup-bs", type=int, default=16)
    ap.add_argument("--unsup-ratio", type=int, default=7)
    ap.add_argument("--lr", type=float, default=0.03)
    ap.add_argument("--wd", type=float, default=5e-4)
    ap.add_argument("--tsa", choices=["none", "linear", "log", "exp"], default="linear")
    ap.add_argument("--uda-softmax-temp", type=float, default=0.4)
    ap.add_argument("--uda-confidence", type=float, default=0.8)
    ap.add_argument("--uda-coeff", type=float, default=1.0)
    return ap.parse_args()


def tsa_threshold(schedule, step, total, num_classes):
    frac = step / total
    if schedule == "linear":
        alpha = frac
    elif schedule == "log":
        alpha = 1 - math.exp(-frac * 5)
    elif schedule == "exp":
        alpha = math.exp((frac - 1) * 5)
    else:
        return 1.0
    return alpha * (1 - 1 / num_classes) + 1 / num_classes


class UnsupPairs(Dataset):
    def __init__(self, base, ori_tf, aug_tf):
        self.base, self.ori_tf, self.aug_tf = base, ori_tf, aug_tf

    def __len__(self):
        return len(self.base)

    def __getitem__(self, i):
        img, _ = self.base[i]
        return self.ori_tf(img), self.aug_tf(img)


def infinite(loader, sampler):
    ep = 0
    while True:
        sampler.set_epoch(ep)
        for b in loader:
            yield b
        ep += 1


def main():
    args = get_args()
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    torch.manual_seed(42)

    run = wandb.init(project=args.wandb_project, name=args.run_name, config=vars(args))

    norm = transforms.Normalize((0.4914, 0.4822, 0.4465), (0.2471, 0.2435, 0.2616))
    ori = transforms.Compose([transforms.RandomCrop(32, 4, padding_mode="reflect"), transforms.RandomHorizontalFlip(),
                              transforms.ToTensor(), norm])
    aug = transforms.Compose([transforms.RandomCrop(32, 4, padding_mode="reflect"), transforms.RandomHorizontalFlip(),
                              transforms.RandAugment(2, 9), transforms.ToTensor(), norm])
    train_plain = datasets.CIFAR10(args.data, train=True)
    train_sup = datasets.CIFAR10(args.data, train=True, transform=ori)
    targets = np.array(train_plain.targets)
    rng = np.random.RandomState(0)
    sup_idx = np.concatenate([rng.choice(np.flatnonzero(targets == c), args.labels // 10, replace=False)
                              for c in range(10)])
    sup_set = Subset(train_sup, sup_idx)
    unsup_set = UnsupPairs(train_plain, ori, aug)
    test_set = datasets.CIFAR10(args.data, train=False, transform=transforms.Compose([transforms.ToTensor(), norm]))

    sup_sampler = DistributedSampler(sup_set, shuffle=True, drop_last=True)
    unsup_sampler = DistributedSampler(unsup_set, shuffle=True, drop_last=True)
    sup_stream = infinite(DataLoader(sup_set, args.sup_bs, sampler=sup_sampler, num_workers=2,
                                     drop_last=True, pin_memory=True), sup_sampler)
    unsup_stream = infinite(DataLoader(unsup_set, args.sup_bs * args.unsup_ratio, sampler=unsup_sampler,
                                       num_workers=8, drop_last=True, pin_memory=True), unsup_sampler)
    test_loader = DataLoader(test_set, 500, sampler=DistributedSampler(test_set, shuffle=False), num_workers=4)

    model = create_model("resnet18", num_classes=10, pretrained=False)
    model.conv1 = nn.Conv2d(3, 64, 3, 1, 1, bias=False)
    model.maxpool = nn.Identity()
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).to(device)
    model = DDP(model, device_ids=[local_rank])
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9, weight_decay=args.wd, nesterov=True)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 0.5 * (1 + math.cos(math.pi * s / args.steps)))
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)

    best = 0.0
    model.train()
    for step in range(1, args.steps + 1):
        xs, ys = next(sup_stream)
        xu_ori, xu_aug = next(unsup_stream)
        n = xs.size(0)
        nu = xu_ori.size(0)
        logits = model(torch.cat([xs, xu_ori, xu_aug]).to(device, non_blocking=True))
        ys = ys.to(device, non_blocking=True)
        logit_sup, logit_ori, logit_aug = logits[:n], logits[n:n + nu], logits[n + nu:]

        # training signal annealing: drop supervised examples the model is already sure about
        thr = tsa_threshold(args.tsa, step, args.steps, 10)
        sup_ce = F.cross_entropy(logit_sup, ys, reduction="none")
        correct_p = logit_sup.softmax(1).gather(1, ys[:, None]).squeeze(1)
        tsa_mask = (correct_p < thr).float().detach()
        sup_loss = (sup_ce * tsa_mask).sum() / tsa_mask.sum().clamp(min=1.0)

        with torch.no_grad():
            ori_prob = F.softmax(logit_ori / args.uda_softmax_temp, dim=1)
            conf_mask = (F.softmax(logit_ori, dim=1).max(1).values > args.uda_confidence).float()
        kl = F.kl_div(F.log_softmax(logit_aug, dim=1), ori_prob, reduction="none").sum(1)
        unsup_loss = (kl * conf_mask).mean()
        loss = sup_loss + args.uda_coeff * unsup_loss

        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        scheduler.step()

        if step % 50 == 0:
            wandb.log({"train/sup_loss": sup_loss.item(), "train/unsup_loss": unsup_loss.item(),
                       "train/tsa_threshold": thr, "train/tsa_kept": tsa_mask.mean().item(),
                       "train/conf_mask": conf_mask.mean().item(), "lr": scheduler.get_last_lr()[0]}, step=step)

        if step % args.eval_interval == 0:
            model.eval()
            acc = torch.zeros(2, device=device)
            with torch.no_grad():
                for x, y in test_loader:
                    acc[0] += (model(x.to(device)).argmax(1) == y.to(device)).sum()
                    acc[1] += y.numel()
            dist.all_reduce(acc)
            top1 = (acc[0] / acc[1]).item()
            wandb.log({"test/top1": top1}, step=step)
            if rank == 0:
                print(f"step {step}: top1 {top1:.4f}", flush=True)
                if top1 > best:
                    best = top1
                    torch.save({"step": step, "model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                                "scheduler": scheduler.state_dict()}, os.path.join(args.out, "best.pth"))
                    run.summary["best_top1"] = best
            model.train()

    run.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
