"""FixMatch, WRN-28-8 on CIFAR-100 (10000 labels).

Launch: torchrun --standalone --nproc_per_node=8 04_fixmatch_wrn_cifar100.py --config configs/fixmatch_c100.yaml
"""
import argparse
import logging
import math
import os
import sys
from dataclasses import dataclass, fields

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import yaml
from timm.utils import ModelEmaV2
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torchvision import datasets, transforms

log = logging.getLogger(__name__)


@dataclass
class Config:
    data_root: str = "/data/cifar100"
    out_dir: str = "output/fixmatch_c100"
    num_labels: int = 10000
    num_classes: int = 100
    widen: int = 8
    iters: int = 1 << 20
    iters_per_eval: int = 2048
    batch_size: int = 8
    uratio: int = 7
    lr: float = 0.03
    weight_decay: float = 1e-3
    p_cutoff: float = 0.95
    ulb_loss_ratio: float = 1.0
    ema_m: float = 0.999
    num_workers: int = 4
    seed: int = 0


def load_config():
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", default=None)
    for f in fields(Config):
        parser.add_argument(f"--{f.name.replace('_', '-')}", type=type(f.default), default=None)
    ns = parser.parse_args()
    cfg = Config()
    if ns.config:
        with open(ns.config) as fh:
            for k, v in (yaml.safe_load(fh) or {}).items():
                setattr(cfg, k, v)
    for f in fields(Config):
        v = getattr(ns, f.name)
        if v is not None:
            setattr(cfg, f.name, v)
    return cfg


def conv_bn(cin, cout, stride):
    return nn.Sequential(nn.BatchNorm2d(cin, momentum=0.001), nn.LeakyReLU(0.1),
                         nn.Conv2d(cin, cout, 3, stride, 1, bias=False))


class WideBlock(nn.Module):
    def __init__(self, cin, cout, stride):
        super().__init__()
        self.a = conv_bn(cin, cout, stride)
        self.b = conv_bn(cout, cout, 1)
        self.proj = nn.Conv2d(cin, cout, 1, stride, bias=False) if (cin != cout or stride != 1) else nn.Identity()

    def forward(self, x):
        return self.b(self.a(x)) + self.proj(x)


class WRN(nn.Module):
    def __init__(self, num_classes, depth=28, widen=8):
        super().__init__()
        n = (depth - 4) // 6
        ch = [16, 16 * widen, 32 * widen, 64 * widen]
        blocks = [nn.Conv2d(3, ch[0], 3, 1, 1, bias=False)]
        for g, s in enumerate([1, 2, 2]):
            for i in range(n):
                blocks.append(WideBlock(ch[g] if i == 0 else ch[g + 1], ch[g + 1], s if i == 0 else 1))
        blocks += [nn.BatchNorm2d(ch[3], momentum=0.001), nn.LeakyReLU(0.1), nn.AdaptiveAvgPool2d(1), nn.Flatten()]
        self.features = nn.Sequential(*blocks)
        self.classifier = nn.Linear(ch[3], num_classes)

    def forward(self, x):
        return self.classifier(self.features(x))


MEAN, STD = (0.5071, 0.4865, 0.4409), (0.2673, 0.2564, 0.2762)


class SSLDataset(Dataset):
    def __init__(self, data, targets, weak, strong=None):
        self.data, self.targets, self.weak, self.strong = data, targets, weak, strong

    def __len__(self):
        return len(self.data)

    def __getitem__(self, i):
        from PIL import Image
        img = Image.fromarray(self.data[i])
        if self.strong is None:
            return self.weak(img), self.targets[i]
        return self.weak(img), self.strong(img)


def build_data(cfg):
    base = datasets.CIFAR100(cfg.data_root, train=True, download=False)
    targets = np.array(base.targets)
    rng = np.random.RandomState(cfg.seed)
    lb_idx = np.concatenate([rng.choice(np.where(targets == c)[0], cfg.num_labels // cfg.num_classes, False)
                             for c in range(cfg.num_classes)])
    weak = transforms.Compose([transforms.RandomCrop(32, 4, padding_mode="reflect"), transforms.RandomHorizontalFlip(),
                               transforms.ToTensor(), transforms.Normalize(MEAN, STD)])
    strong = transforms.Compose([transforms.RandomCrop(32, 4, padding_mode="reflect"), transforms.RandomHorizontalFlip(),
                                 transforms.RandAugment(3, 5), transforms.ToTensor(), transforms.Normalize(MEAN, STD)])
    lb = SSLDataset(base.data[lb_idx], targets[lb_idx], weak)
    ulb = SSLDataset(base.data, targets, weak, strong)
    test = datasets.CIFAR100(cfg.data_root, train=False,
                             transform=transforms.Compose([transforms.ToTensor(), transforms.Normalize(MEAN, STD)]))
    return lb, ulb, test


def infinite(loader, sampler):
    epoch = 0
    while True:
        sampler.set_epoch(epoch)
        yield from loader
        epoch += 1


@torch.no_grad()
def evaluate(net, loader, device):
    net.eval()
    top1 = torch.zeros(2, device=device)
    for x, y in loader:
        x, y = x.to(device), y.to(device)
        top1[0] += (net(x).argmax(-1) == y).sum()
        top1[1] += len(y)
    dist.all_reduce(top1)
    net.train()
    return (top1[0] / top1[1]).item()


def main():
    cfg = load_config()
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    logging.basicConfig(stream=sys.stdout, level=logging.INFO if rank == 0 else logging.ERROR,
                        format=f"[rank{rank}] %(asctime)s %(message)s")
    torch.manual_seed(cfg.seed)
    np.random.seed(cfg.seed + rank)

    lb_set, ulb_set, test_set = build_data(cfg)
    lb_sampler = DistributedSampler(lb_set, drop_last=True)
    ulb_sampler = DistributedSampler(ulb_set, drop_last=True)
    lb_loader = DataLoader(lb_set, cfg.batch_size, sampler=lb_sampler, num_workers=cfg.num_workers,
                           drop_last=True, pin_memory=True, persistent_workers=True)
    ulb_loader = DataLoader(ulb_set, cfg.batch_size * cfg.uratio, sampler=ulb_sampler,
                            num_workers=cfg.num_workers, drop_last=True, pin_memory=True, persistent_workers=True)
    test_loader = DataLoader(test_set, 512, sampler=DistributedSampler(test_set, shuffle=False), num_workers=2)

    model = WRN(cfg.num_classes, widen=cfg.widen).to(device)
    ema = ModelEmaV2(model, decay=cfg.ema_m)
    decay, no_decay = [], []
    for n, p in model.named_parameters():
        (no_decay if p.ndim <= 1 else decay).append(p)
    opt = torch.optim.SGD([{"params": decay, "weight_decay": cfg.weight_decay},
                           {"params": no_decay, "weight_decay": 0.0}], lr=cfg.lr, momentum=0.9, nesterov=True)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda it: math.cos(7 * math.pi * it / (16 * cfg.iters)))
    model = DDP(model, device_ids=[local_rank])

    os.makedirs(cfg.out_dir, exist_ok=True)
    lb_stream, ulb_stream = infinite(lb_loader, lb_sampler), infinite(ulb_loader, ulb_sampler)
    best = 0.0
    model.train()
    for it in range(cfg.iters):
        x_lb, y_lb = next(lb_stream)
        x_ulb_w, x_ulb_s = next(ulb_stream)
        x_lb, y_lb = x_lb.to(device, non_blocking=True), y_lb.to(device, non_blocking=True)
        x_ulb_w, x_ulb_s = x_ulb_w.to(device, non_blocking=True), x_ulb_s.to(device, non_blocking=True)

        logits_lb = model(x_lb)
        with torch.no_grad():
            probs_w = model(x_ulb_w).softmax(-1)
        logits_s = model(x_ulb_s)

        sup_loss = F.cross_entropy(logits_lb, y_lb)
        conf, pseudo = probs_w.max(-1)
        mask = (conf >= cfg.p_cutoff).float()
        unsup_loss = (F.cross_entropy(logits_s, pseudo, reduction="none") * mask).mean()
        total = sup_loss + cfg.ulb_loss_ratio * unsup_loss

        opt.zero_grad(set_to_none=True)
        total.backward()
        opt.step()
        sched.step()
        ema.update(model.module)

        if it % 200 == 0:
            log.info("it %d sup %.4f unsup %.4f mask %.3f lr %.5f", it, sup_loss.item(), unsup_loss.item(),
                     mask.mean().item(), sched.get_last_lr()[0])
        if (it + 1) % cfg.iters_per_eval == 0:
            acc = evaluate(ema.module, test_loader, device)
            if rank == 0:
                state = {"it": it + 1, "model": model.module.state_dict(), "ema": ema.module.state_dict(),
                         "opt": opt.state_dict(), "sched": sched.state_dict()}
                torch.save(state, os.path.join(cfg.out_dir, "latest_model.pth"))
                if acc > best:
                    best = acc
                    torch.save(state, os.path.join(cfg.out_dir, "model_best.pth"))
                log.info("it %d ema top1 %.4f best %.4f", it + 1, acc, best)
            model.train()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
