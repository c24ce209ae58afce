"""FreeMatch (Wang et al., ICLR 2023): self-adaptive thresholding for FixMatch-style SSL.

The global threshold tau_t is an EMA of the mean max-confidence on unlabelled data,
modulated class-wise by an EMA of the predicted class distribution.  The batch
statistics are averaged over all GPUs so every rank keeps the same thresholds.

    torchrun --nproc_per_node=4 14_freematch_sat.py --dataset cifar10 --num-labels 40
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
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torchvision import datasets, transforms

from nets import wrn_28_2, wrn_28_8

NORM = {"cifar10": ((0.4914, 0.4822, 0.4465), (0.2471, 0.2435, 0.2616)),
        "cifar100": ((0.5071, 0.4865, 0.4409), (0.2673, 0.2564, 0.2762))}


def get_config():
    p = argparse.ArgumentParser()
    p.add_argument("--dataset", default="cifar10", choices=["cifar10", "cifar100"])
    p.add_argument("--data-dir", default="./data")
    p.add_argument("--save-dir", default="./saved/freematch")
    p.add_argument("--num-labels", type=int, default=40)
    p.add_argument("--batch-size", type=int, default=16, help="per GPU")
    p.add_argument("--uratio", type=int, default=7)
    p.add_argument("--lr", type=float, default=0.03)
    p.add_argument("--wd", type=float, default=5e-4)
    p.add_argument("--iters", type=int, default=1 << 20)
    p.add_argument("--eval-iters", type=int, default=5120)
    p.add_argument("--ema-p", type=float, default=0.999, help="momentum of the threshold statistics")
    p.add_argument("--ema-m", type=float, default=0.999, help="model EMA")
    p.add_argument("--lambda-u", type=float, default=1.0)
    p.add_argument("--lambda-f", type=float, default=0.0, help="self-adaptive fairness weight")
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


def get_split(cfg, targets, num_classes):
    cache = os.path.join(cfg.data_dir, "ssl_splits", f"{cfg.dataset}_{cfg.num_labels}_seed{cfg.seed}.npz")
    if os.path.exists(cache):
        d = np.load(cache)
        return d["lb"], d["ulb"]
    rng = np.random.RandomState(cfg.seed)
    targets = np.asarray(targets)
    lb = np.concatenate([rng.choice(np.where(targets == c)[0], cfg.num_labels // num_classes, replace=False)
                         for c in range(num_classes)])
    ulb = np.arange(len(targets))
    os.makedirs(os.path.dirname(cache), exist_ok=True)
    np.savez(cache, lb=lb, ulb=ulb)
    return lb, ulb


class SSLData(Dataset):
    def __init__(self, data, targets, mean, std, strong=False, repeat=1):
        self.data, self.targets, self.strong_aug = data, np.asarray(targets), strong
        self.repeat = repeat
        flip_crop = [transforms.RandomHorizontalFlip(), transforms.RandomCrop(32, 4, padding_mode="reflect")]
        to_t = [transforms.ToTensor(), transforms.Normalize(mean, std)]
        self.weak = transforms.Compose(flip_crop + to_t)
        self.strong = transforms.Compose(flip_crop + [transforms.RandAugment(3, 10)] + to_t)

    def __len__(self):
        return len(self.data) * self.repeat

    def __getitem__(self, i):
        i = i % len(self.data)
        img = Image.fromarray(self.data[i])
        if self.strong_aug:
            return self.weak(img), self.strong(img)
        return self.weak(img), int(self.targets[i])


class SelfAdaptiveThreshold:
    def __init__(self, num_classes, m, device):
        self.m = m
        self.time_p = torch.tensor(1.0 / num_classes, device=device)
        self.p_model = torch.full((num_classes,), 1.0 / num_classes, device=device)
        self.label_hist = torch.full((num_classes,), 1.0 / num_classes, device=device)

    @torch.no_grad()
    def update(self, probs):
        max_p, idx = probs.max(dim=-1)
        num_classes = probs.size(1)
        stats = torch.cat([max_p.mean().view(1), probs.mean(0),
                           torch.bincount(idx, minlength=num_classes).float() / idx.numel()])
        dist.all_reduce(stats)
        stats /= dist.get_world_size()
        self.time_p = self.time_p * self.m + (1 - self.m) * stats[0]
        self.p_model = self.p_model * self.m + (1 - self.m) * stats[1:1 + num_classes]
        self.label_hist = self.label_hist * self.m + (1 - self.m) * stats[1 + num_classes:]

    @torch.no_grad()
    def mask(self, probs):
        max_p, idx = probs.max(dim=-1)
        mod = self.p_model / self.p_model.max()
        return max_p.ge(self.time_p * mod[idx]).float()

    def state_dict(self):
        return {"time_p": self.time_p, "p_model": self.p_model, "label_hist": self.label_hist}


def fairness_loss(mask, logits_s, p_model, label_hist):
    probs_s = logits_s.softmax(-1)
    _, idx_s = probs_s.max(-1)
    hist_s = torch.bincount(idx_s, minlength=logits_s.size(1)).float()
    hist_s = hist_s / hist_s.sum()
    mod_p = p_model / label_hist
    mod_p = mod_p / mod_p.sum()
    mean_s = (probs_s * mask[:, None]).sum(0) / mask.sum().clamp(min=1)
    mod_s = mean_s / hist_s.clamp(min=1e-6)
    mod_s = mod_s / mod_s.sum()
    return (mod_p * torch.log(mod_s + 1e-12)).sum()


@torch.no_grad()
def evaluate(net, loader, device):
    net.eval()
    ok = n = 0
    for x, y in loader:
        x, y = x.to(device), y.to(device)
        ok += (net(x).argmax(1) == y).sum().item()
        n += y.numel()
    return 100.0 * ok / n


def main():
    cfg = get_config()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(cfg.seed)

    ds_cls = datasets.CIFAR10 if cfg.dataset == "cifar10" else datasets.CIFAR100
    num_classes = 10 if cfg.dataset == "cifar10" else 100
    if rank == 0:
        ds_cls(cfg.data_dir, train=True, download=True)
        ds_cls(cfg.data_dir, train=False, download=True)
    dist.barrier()
    train = ds_cls(cfg.data_dir, train=True)
    mean, std = NORM[cfg.dataset]
    lb_idx, ulb_idx = get_split(cfg, train.targets, num_classes)

    targets = np.asarray(train.targets)
    rep = max(1, math.ceil(cfg.batch_size * world * 1024 / len(lb_idx)))
    lb_set = SSLData(train.data[lb_idx], targets[lb_idx], mean, std, repeat=rep)
    ulb_set = SSLData(train.data[ulb_idx], targets[ulb_idx], mean, std, strong=True)
    test_set = ds_cls(cfg.data_dir, train=False,
                      transform=transforms.Compose([transforms.ToTensor(), transforms.Normalize(mean, std)]))

    lb_sampler = DistributedSampler(lb_set, drop_last=True, seed=cfg.seed)
    ulb_sampler = DistributedSampler(ulb_set, drop_last=True, seed=cfg.seed)
    lb_loader = DataLoader(lb_set, cfg.batch_size, sampler=lb_sampler, num_workers=cfg.workers,
                           pin_memory=True, drop_last=True)
    ulb_loader = DataLoader(ulb_set, cfg.batch_size * cfg.uratio, sampler=ulb_sampler,
                            num_workers=cfg.workers, pin_memory=True, drop_last=True)
    test_loader = DataLoader(test_set, 1024, num_workers=cfg.workers)

    net = (wrn_28_2 if num_classes == 10 else wrn_28_8)(num_classes=num_classes).to(device)
    ema_net = deepcopy(net).eval()
    model = DDP(net, device_ids=[local_rank])
    decay = [p for n, p in model.named_parameters() if p.ndim > 1]
    no_decay = [p for n, p in model.named_parameters() if p.ndim <= 1]
    optimizer = torch.optim.SGD([{"params": decay, "weight_decay": cfg.wd},
                                 {"params": no_decay, "weight_decay": 0.0}],
                                lr=cfg.lr, momentum=0.9, nesterov=True)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda it: math.cos(7 * math.pi * it / (16 * cfg.iters)))
    sat = SelfAdaptiveThreshold(num_classes, cfg.ema_p, device)

    lb_ep = ulb_ep = 0
    lb_iter, ulb_iter = iter(lb_loader), iter(ulb_loader)
    best, tic = 0.0, time.time()
    model.train()
    for it in range(1, cfg.iters + 1):
        try:
            x_lb, y_lb = next(lb_iter)
        except StopIteration:
            lb_ep += 1
            lb_sampler.set_epoch(lb_ep)
            lb_iter = iter(lb_loader)
            x_lb, y_lb = next(lb_iter)
        try:
            x_w, x_s = next(ulb_iter)
        except StopIteration:
            ulb_ep += 1
            ulb_sampler.set_epoch(ulb_ep)
            ulb_iter = iter(ulb_loader)
            x_w, x_s = next(ulb_iter)

        n = x_lb.size(0)
        logits = model(torch.cat([x_lb, x_w, x_s]).to(device, non_blocking=True))
        y_lb = y_lb.to(device, non_blocking=True)
        logits_lb, (logits_w, logits_s) = logits[:n], logits[n:].chunk(2)
        sup = F.cross_entropy(logits_lb, y_lb)
        probs_w = logits_w.detach().softmax(-1)
        sat.update(probs_w)
        mask = sat.mask(probs_w)
        pseudo = probs_w.argmax(-1)
        unsup = (F.cross_entropy(logits_s, pseudo, reduction="none") * mask).mean()
        loss = sup + cfg.lambda_u * unsup
        if cfg.lambda_f > 0:
            loss = loss + cfg.lambda_f * fairness_loss(mask, logits_s, sat.p_model, sat.label_hist)

        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        scheduler.step()
        with torch.no_grad():
            for pe, pm in zip(ema_net.parameters(), model.module.parameters()):
                pe.mul_(cfg.ema_m).add_(pm.detach(), alpha=1 - cfg.ema_m)
            for be, bm in zip(ema_net.buffers(), model.module.buffers()):
                be.copy_(bm)

        if rank == 0 and it % 200 == 0:
            print(f"it {it} sup {sup.item():.4f} unsup {unsup.item():.4f} mask {mask.mean().item():.3f} "
                  f"tau {sat.time_p.item():.3f} {(time.time() - tic) / 200:.3f}s/it", flush=True)
            tic = time.time()

        if it % cfg.eval_iters == 0:
            if rank == 0:
                acc = evaluate(ema_net, test_loader, device)
                os.makedirs(cfg.save_dir, exist_ok=True)
                state = {"model": model.module.state_dict(), "ema_model": ema_net.state_dict(),
                         "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(),
                         "sat": sat.state_dict(), "it": it, "acc": acc}
                torch.save(state, os.path.join(cfg.save_dir, "latest_model.pth"))
                if acc > best:
                    best = acc
                    torch.save(state, os.path.join(cfg.save_dir, "model_best.pth"))
                print(f"[eval] it {it} top-1 {acc:.2f} best {best:.2f}", flush=True)
            dist.barrier()
            model.train()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
