"""FixMatch with separate forward passes for labelled and unlabelled batches.

We found that running the labelled batch through the network on its own (rather than
interleaving it with the 7x larger unlabelled batch) gives cleaner BatchNorm
statistics for the supervised term on CIFAR-100.

    torchrun --nproc_per_node=4 10_fixmatch_cifar100_wrn28_8.py --dataset cifar100 --n-labels 10000
"""
import argparse
import dataclasses
import json
import math
import os
import time
from copy import deepcopy
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

from semilearn_lite.data import build_ssl_cifar
from semilearn_lite.nets import wrn_28_8


@dataclass
class Config:
    dataset: str = "cifar100"
    data_dir: str = "./data"
    out_dir: str = "./outputs/fixmatch_splitbn"
    n_labels: int = 10000
    lb_batch: int = 16          # per GPU
    uratio: int = 7
    lr: float = 0.03
    wd: float = 1e-3
    total_iters: int = 1 << 20
    eval_every: int = 4096
    tau: float = 0.95
    lambda_u: float = 1.0
    ema: float = 0.999
    workers: int = 4
    seed: int = 0
    resume: str = ""


def parse_config() -> Config:
    ap = argparse.ArgumentParser()
    for f in dataclasses.fields(Config):
        ap.add_argument("--" + f.name.replace("_", "-"), type=type(f.default), default=f.default)
    return Config(**vars(ap.parse_args()))


class EMA:
    def __init__(self, net, decay):
        self.net = deepcopy(net).eval()
        self.decay = decay
        for p in self.net.parameters():
            p.requires_grad_(False)

    @torch.no_grad()
    def update(self, net):
        for (k, e), (_, p) in zip(self.net.state_dict().items(), net.state_dict().items()):
            if e.is_floating_point():
                e.lerp_(p, 1.0 - self.decay)
            else:
                e.copy_(p)


def cycle_with_epochs(loader, sampler):
    ep = 0
    while True:
        sampler.set_epoch(ep)
        yield from loader
        ep += 1


@torch.no_grad()
def evaluate(net, loader, device):
    net.eval()
    top1 = top5 = n = 0
    for x, y in loader:
        x, y = x.to(device), y.to(device)
        out = net(x)
        _, pred = out.topk(5, dim=1)
        top1 += (pred[:, 0] == y).sum().item()
        top5 += (pred == y[:, None]).any(1).sum().item()
        n += y.numel()
    return 100.0 * top1 / n, 100.0 * top5 / n


def main():
    cfg = parse_config()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(cfg.seed)
    np.random.seed(cfg.seed)

    if rank == 0:
        os.makedirs(cfg.out_dir, exist_ok=True)
        with open(os.path.join(cfg.out_dir, "config.json"), "w") as f:
            json.dump(dataclasses.asdict(cfg), f, indent=2)
        build_ssl_cifar(cfg.dataset, cfg.data_dir, cfg.n_labels, seed=cfg.seed, download=True)
    dist.barrier()
    lb_set, ulb_set, test_set, num_classes = build_ssl_cifar(cfg.dataset, cfg.data_dir, cfg.n_labels,
                                                             seed=cfg.seed, download=False)

    lb_sampler = DistributedSampler(lb_set, shuffle=True, drop_last=True)
    ulb_sampler = DistributedSampler(ulb_set, shuffle=True, drop_last=True)
    lb_loader = DataLoader(lb_set, batch_size=cfg.lb_batch, sampler=lb_sampler, num_workers=cfg.workers,
                           pin_memory=True, drop_last=True, persistent_workers=True)
    ulb_loader = DataLoader(ulb_set, batch_size=cfg.lb_batch * cfg.uratio, sampler=ulb_sampler,
                            num_workers=cfg.workers, pin_memory=True, drop_last=True, persistent_workers=True)
    test_loader = DataLoader(test_set, batch_size=500, num_workers=cfg.workers)

    net = wrn_28_8(num_classes=num_classes).to(device)
    ema = EMA(net, cfg.ema)
    model = DDP(net, device_ids=[local_rank], output_device=local_rank)

    wd_params, no_wd_params = [], []
    for name, p in model.named_parameters():
        (no_wd_params if p.ndim <= 1 else wd_params).append(p)
    optimizer = torch.optim.SGD([{"params": wd_params, "weight_decay": cfg.wd},
                                 {"params": no_wd_params, "weight_decay": 0.0}],
                                lr=cfg.lr, momentum=0.9, nesterov=True)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda i: math.cos(7.0 * math.pi * i / (16.0 * cfg.total_iters)))

    start, best = 0, 0.0
    if cfg.resume:
        ck = torch.load(cfg.resume, map_location="cpu")
        model.module.load_state_dict(ck["model"])
        ema.net.load_state_dict(ck["ema"])
        optimizer.load_state_dict(ck["optimizer"])
        scheduler.load_state_dict(ck["scheduler"])
        start, best = ck["iter"], ck["best"]

    lb_stream = cycle_with_epochs(lb_loader, lb_sampler)
    ulb_stream = cycle_with_epochs(ulb_loader, ulb_sampler)
    model.train()
    t_last = time.time()
    for it in range(start, cfg.total_iters):
        x_lb, y_lb = next(lb_stream)
        (x_w, x_s), _ = next(ulb_stream)
        x_lb, y_lb = x_lb.to(device, non_blocking=True), y_lb.to(device, non_blocking=True)
        x_ulb = torch.cat([x_w, x_s]).to(device, non_blocking=True)

        logits_lb = model(x_lb)
        logits_w, logits_s = model(x_ulb).chunk(2)

        loss_lb = F.cross_entropy(logits_lb, y_lb)
        probs = logits_w.detach().softmax(dim=-1)
        conf, pl = probs.max(dim=-1)
        mask = conf.ge(cfg.tau).float()
        loss_ulb = (F.cross_entropy(logits_s, pl, reduction="none") * mask).mean()
        loss = loss_lb + cfg.lambda_u * loss_ulb

        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        scheduler.step()
        ema.update(model.module)

        if rank == 0 and (it + 1) % 200 == 0:
            dt = (time.time() - t_last) / 200
            t_last = time.time()
            print(f"iter {it + 1}: loss_lb {loss_lb.item():.4f} loss_ulb {loss_ulb.item():.4f} "
                  f"mask {mask.mean().item():.3f} lr {scheduler.get_last_lr()[0]:.5f} {dt:.3f}s/it",
                  flush=True)

        if (it + 1) % cfg.eval_every == 0:
            if rank == 0:
                top1, top5 = evaluate(ema.net, test_loader, device)
                best = max(best, top1)
                ck = {"model": model.module.state_dict(), "ema": ema.net.state_dict(),
                      "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(),
                      "iter": it + 1, "best": best}
                torch.save(ck, os.path.join(cfg.out_dir, "last.pt"))
                if top1 >= best:
                    torch.save(ck, os.path.join(cfg.out_dir, "best.pt"))
                with open(os.path.join(cfg.out_dir, "log.txt"), "a") as f:
                    f.write(json.dumps({"iter": it + 1, "top1": top1, "top5": top5, "best": best}) + "\n")
                print(f"[eval] iter {it + 1} top1 {top1:.2f} top5 {top5:.2f} best {best:.2f}", flush=True)
            dist.barrier()
            model.train()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
