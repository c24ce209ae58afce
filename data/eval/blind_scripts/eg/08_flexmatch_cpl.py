"""FlexMatch: FixMatch with curriculum pseudo-labelling (class-wise flexible thresholds).

The learning effect of each class is estimated from how many unlabelled samples are
currently predicted as that class above the fixed threshold; the per-class
threshold is then scaled by the (warmed-up, convex-mapped) learning effect.

    torchrun --nproc_per_node=4 08_flexmatch_cpl.py --dataset cifar100 --num-labels 2500
"""
import argparse
import math
import os
import time
from copy import deepcopy

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler
from torchvision import datasets, transforms

from ssl_lib.models import wrn_28_2, wrn_28_8
from ssl_lib.augment import RandAugment

STATS = {"cifar10": ((0.4914, 0.4822, 0.4465), (0.2471, 0.2435, 0.2616)),
         "cifar100": ((0.5071, 0.4865, 0.4409), (0.2673, 0.2564, 0.2762))}


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--dataset", default="cifar10", choices=list(STATS))
    p.add_argument("--data-dir", default="./data")
    p.add_argument("--save-dir", default="./saved_models/flexmatch")
    p.add_argument("--num-labels", type=int, default=40)
    p.add_argument("--batch-size", type=int, default=16, help="labelled batch per process")
    p.add_argument("--uratio", type=int, default=7)
    p.add_argument("--lr", type=float, default=0.03)
    p.add_argument("--weight-decay", type=float, default=5e-4)
    p.add_argument("--num-train-iter", type=int, default=1 << 20)
    p.add_argument("--num-eval-iter", type=int, default=5000)
    p.add_argument("--p-cutoff", type=float, default=0.95)
    p.add_argument("--thresh-warmup", action="store_true", default=True)
    p.add_argument("--ema-m", type=float, default=0.999)
    p.add_argument("--num-workers", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


class IndexedSSL(Dataset):
    """Returns (index, weak view, strong view) for the unlabelled stream."""

    def __init__(self, data, mean, std):
        self.data = data
        base = [transforms.RandomHorizontalFlip(), transforms.RandomCrop(32, padding=4, padding_mode="reflect")]
        post = [transforms.ToTensor(), transforms.Normalize(mean, std)]
        self.weak = transforms.Compose(base + post)
        self.strong = transforms.Compose(base + [RandAugment(3, 5)] + post)

    def __len__(self):
        return len(self.data)

    def __getitem__(self, i):
        img = Image.fromarray(self.data[i])
        return i, self.weak(img), self.strong(img)


def split_ssl(targets, num_labels, num_classes, seed):
    rs = np.random.RandomState(seed)
    targets = np.asarray(targets)
    lb = []
    for c in range(num_classes):
        idx = np.where(targets == c)[0]
        lb.extend(rs.choice(idx, num_labels // num_classes, replace=False).tolist())
    return np.array(lb)


class FlexMatchTrainer:
    def __init__(self, args, rank, world, local_rank):
        self.args, self.rank, self.world = args, rank, world
        self.device = torch.device("cuda", local_rank)
        mean, std = STATS[args.dataset]
        ds_cls = datasets.CIFAR10 if args.dataset == "cifar10" else datasets.CIFAR100
        self.num_classes = 10 if args.dataset == "cifar10" else 100

        if rank == 0:
            ds_cls(args.data_dir, train=True, download=True)
            ds_cls(args.data_dir, train=False, download=True)
        dist.barrier()
        train = ds_cls(args.data_dir, train=True)
        lb_idx = split_ssl(train.targets, args.num_labels, self.num_classes, args.seed)
        n_rep = math.ceil(args.batch_size * world * args.num_eval_iter / len(lb_idx))
        lb_tf = transforms.Compose([transforms.RandomHorizontalFlip(),
                                    transforms.RandomCrop(32, padding=4, padding_mode="reflect"),
                                    transforms.ToTensor(), transforms.Normalize(mean, std)])
        lb_set = Subset(ds_cls(args.data_dir, train=True, transform=lb_tf), np.tile(lb_idx, n_rep))
        self.ulb_set = IndexedSSL(train.data, mean, std)
        test_set = ds_cls(args.data_dir, train=False,
                          transform=transforms.Compose([transforms.ToTensor(), transforms.Normalize(mean, std)]))

        self.lb_sampler = DistributedSampler(lb_set, drop_last=True, seed=args.seed)
        self.ulb_sampler = DistributedSampler(self.ulb_set, drop_last=True, seed=args.seed)
        self.lb_loader = DataLoader(lb_set, args.batch_size, sampler=self.lb_sampler,
                                    num_workers=args.num_workers, pin_memory=True, drop_last=True)
        self.ulb_loader = DataLoader(self.ulb_set, args.batch_size * args.uratio, sampler=self.ulb_sampler,
                                     num_workers=args.num_workers, pin_memory=True, drop_last=True)
        shard = list(range(rank, len(test_set), world))
        self.test_loader = DataLoader(Subset(test_set, shard), 512, num_workers=args.num_workers)

        net = (wrn_28_2 if self.num_classes == 10 else wrn_28_8)(num_classes=self.num_classes).to(self.device)
        self.ema = deepcopy(net).eval()
        for p in self.ema.parameters():
            p.requires_grad_(False)
        self.model = DDP(net, device_ids=[local_rank])
        decay = [p for n, p in net.named_parameters() if "bn" not in n and "bias" not in n]
        no_decay = [p for n, p in net.named_parameters() if "bn" in n or "bias" in n]
        self.opt = torch.optim.SGD([{"params": decay, "weight_decay": args.weight_decay},
                                    {"params": no_decay, "weight_decay": 0.0}],
                                   lr=args.lr, momentum=0.9, nesterov=True)
        total = args.num_train_iter
        self.sched = torch.optim.lr_scheduler.LambdaLR(
            self.opt, lambda it: max(0.0, math.cos(7 * math.pi * it / (16 * total))))

        # -1 = not (yet) confidently predicted
        self.selected_label = torch.full((len(self.ulb_set),), -1, dtype=torch.long, device=self.device)
        self.classwise_acc = torch.zeros(self.num_classes, device=self.device)

    @torch.no_grad()
    def update_classwise_acc(self):
        counts = torch.bincount(self.selected_label[self.selected_label >= 0], minlength=self.num_classes)
        n_unused = (self.selected_label < 0).sum()
        if self.args.thresh_warmup:
            denom = torch.maximum(counts.max(), n_unused)
        else:
            denom = counts.max()
        if denom > 0:
            self.classwise_acc = counts.float() / denom.float()

    @torch.no_grad()
    def record_confident(self, idx, pseudo, select):
        sel_idx = idx[select]
        sel_lab = pseudo[select]
        all_idx = [torch.zeros_like(sel_idx) for _ in range(self.world)]
        all_lab = [torch.zeros_like(sel_lab) for _ in range(self.world)]
        dist.all_gather(all_idx, sel_idx)
        dist.all_gather(all_lab, sel_lab)
        self.selected_label[torch.cat(all_idx)] = torch.cat(all_lab)

    @torch.no_grad()
    def ema_step(self):
        m = self.args.ema_m
        for pe, pm in zip(self.ema.parameters(), self.model.module.parameters()):
            pe.mul_(m).add_(pm.detach(), alpha=1 - m)
        for be, bm in zip(self.ema.buffers(), self.model.module.buffers()):
            be.copy_(bm)

    @torch.no_grad()
    def evaluate(self):
        self.ema.eval()
        stat = torch.zeros(2, device=self.device)
        for x, y in self.test_loader:
            x, y = x.to(self.device), y.to(self.device)
            stat[0] += (self.ema(x).argmax(1) == y).sum()
            stat[1] += y.numel()
        dist.all_reduce(stat)
        return (stat[0] / stat[1] * 100).item()

    def train(self):
        a = self.args
        it, lb_ep, ulb_ep, best = 0, 0, 0, 0.0
        lb_iter, ulb_iter = iter(self.lb_loader), iter(self.ulb_loader)
        self.model.train()
        tic = time.time()
        while it < a.num_train_iter:
            try:
                x_lb, y_lb = next(lb_iter)
            except StopIteration:
                lb_ep += 1
                self.lb_sampler.set_epoch(lb_ep)
                lb_iter = iter(self.lb_loader)
                x_lb, y_lb = next(lb_iter)
            try:
                idx_ulb, x_w, x_s = next(ulb_iter)
            except StopIteration:
                ulb_ep += 1
                self.ulb_sampler.set_epoch(ulb_ep)
                ulb_iter = iter(self.ulb_loader)
                idx_ulb, x_w, x_s = next(ulb_iter)

            n_lb = x_lb.size(0)
            x = torch.cat([x_lb, x_w, x_s]).to(self.device, non_blocking=True)
            y_lb = y_lb.to(self.device, non_blocking=True)
            idx_ulb = idx_ulb.to(self.device, non_blocking=True)

            self.update_classwise_acc()
            logits = self.model(x)
            logits_lb = logits[:n_lb]
            logits_w, logits_s = logits[n_lb:].chunk(2)
            sup = F.cross_entropy(logits_lb, y_lb)

            with torch.no_grad():
                probs = torch.softmax(logits_w, dim=-1)
                max_p, pseudo = probs.max(dim=-1)
                beta = self.classwise_acc[pseudo]
                mask = max_p.ge(a.p_cutoff * (beta / (2.0 - beta)))
                select = max_p.ge(a.p_cutoff)
            unsup = (F.cross_entropy(logits_s, pseudo, reduction="none") * mask.float()).mean()
            loss = sup + unsup

            self.opt.zero_grad(set_to_none=True)
            loss.backward()
            self.opt.step()
            self.sched.step()
            self.ema_step()
            self.record_confident(idx_ulb, pseudo, select)
            it += 1

            if it % 100 == 0 and self.rank == 0:
                print(f"it {it} sup {sup.item():.4f} unsup {unsup.item():.4f} mask {mask.float().mean():.3f} "
                      f"used {(self.selected_label >= 0).float().mean():.3f} "
                      f"{(time.time() - tic) / 100:.3f}s/it", flush=True)
                tic = time.time()

            if it % a.num_eval_iter == 0:
                acc = self.evaluate()
                if self.rank == 0:
                    os.makedirs(a.save_dir, exist_ok=True)
                    state = {"it": it, "model": self.model.module.state_dict(), "ema": self.ema.state_dict(),
                             "optimizer": self.opt.state_dict(), "scheduler": self.sched.state_dict(),
                             "selected_label": self.selected_label.cpu(), "acc": acc}
                    torch.save(state, os.path.join(a.save_dir, "latest_model.pth"))
                    if acc > best:
                        best = acc
                        torch.save(state, os.path.join(a.save_dir, "model_best.pth"))
                    print(f"[eval] it {it} acc {acc:.2f} best {best:.2f}", flush=True)
                self.model.train()


def main():
    args = parse()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    torch.manual_seed(args.seed)
    np.random.seed(args.seed)
    trainer = FlexMatchTrainer(args, dist.get_rank(), dist.get_world_size(), local_rank)
    trainer.train()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
