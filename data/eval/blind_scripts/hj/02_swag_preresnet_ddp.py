"""SWAG (Maddox et al., 2019) for PreResNet-56 on CIFAR-100 with DDP.

Phase 1: SGD with cosine decay to the SWA learning rate.
Phase 2: constant-LR SGD; collect first/second moments and the low-rank
         deviation matrix once per epoch.
Eval:   Bayesian model averaging over S SWAG samples, the samples are split
        across ranks and the predictive probabilities are summed with all_reduce.

    torchrun --nnodes=1 --nproc_per_node=4 02_swag_preresnet_ddp.py --config swag_c100.yaml
"""
import argparse
import copy
import math
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import yaml
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler
import torchvision
import torchvision.transforms as T


DEFAULTS = dict(
    data_dir="/data/cifar100", out_dir="runs/swag_c100", epochs=300, swa_start=161,
    batch_size=64, lr_init=0.1, swa_lr=0.01, wd=3e-4, max_rank=20, n_samples=30,
    scale=0.5, workers=6, seed=1,
)


# ------------------------------------------------------------------ model
class PreActBlock(nn.Module):
    def __init__(self, cin, cout, stride):
        super().__init__()
        self.bn1 = nn.BatchNorm2d(cin)
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.short = None
        if stride != 1 or cin != cout:
            self.short = nn.Conv2d(cin, cout, 1, stride, bias=False)

    def forward(self, x):
        out = F.relu(self.bn1(x))
        sc = self.short(out) if self.short is not None else x
        out = self.conv1(out)
        out = self.conv2(F.relu(self.bn2(out)))
        return out + sc


class PreResNet(nn.Module):
    def __init__(self, depth=56, num_classes=100):
        super().__init__()
        n = (depth - 2) // 6
        self.conv = nn.Conv2d(3, 16, 3, 1, 1, bias=False)
        layers, cin = [], 16
        for cout, stride in ((16, 1), (32, 2), (64, 2)):
            for i in range(n):
                layers.append(PreActBlock(cin, cout, stride if i == 0 else 1))
                cin = cout
        self.layers = nn.Sequential(*layers)
        self.bn = nn.BatchNorm2d(64)
        self.fc = nn.Linear(64, num_classes)

    def forward(self, x):
        x = self.layers(self.conv(x))
        x = F.adaptive_avg_pool2d(F.relu(self.bn(x)), 1).flatten(1)
        return self.fc(x)


# ------------------------------------------------------------------ SWAG
class SWAG:
    """Keeps mean, sq-mean and deviation columns as flat vectors on the GPU."""

    def __init__(self, module, max_rank):
        self.params = [p for p in module.parameters()]
        n = sum(p.numel() for p in self.params)
        dev = self.params[0].device
        self.mean = torch.zeros(n, device=dev)
        self.sq_mean = torch.zeros(n, device=dev)
        self.dev_cols = []
        self.n_models = 0
        self.max_rank = max_rank

    def _flat(self):
        return torch.cat([p.detach().reshape(-1) for p in self.params]).float()

    @torch.no_grad()
    def collect(self):
        w = self._flat()
        k = self.n_models
        self.mean.mul_(k / (k + 1)).add_(w / (k + 1))
        self.sq_mean.mul_(k / (k + 1)).add_(w * w / (k + 1))
        self.dev_cols.append(w - self.mean)
        if len(self.dev_cols) > self.max_rank:
            self.dev_cols.pop(0)
        self.n_models += 1

    def state_dict(self):
        return {"mean": self.mean.cpu(), "sq_mean": self.sq_mean.cpu(),
                "dev": torch.stack(self.dev_cols).cpu(), "n_models": self.n_models}

    @staticmethod
    @torch.no_grad()
    def sample(state, scale, generator, device):
        mean, sq, D = state["mean"].to(device), state["sq_mean"].to(device), state["dev"].to(device)
        var = (sq - mean ** 2).clamp_min(1e-30)
        z1 = torch.randn(mean.shape, generator=generator, device=device)
        z2 = torch.randn(D.shape[0], generator=generator, device=device)
        diag = var.sqrt() * z1
        low = D.t() @ z2 / math.sqrt(max(D.shape[0] - 1, 1))
        return mean + math.sqrt(scale) * (diag + low) / math.sqrt(2.0)


def load_flat(module, flat):
    offset = 0
    for p in module.parameters():
        n = p.numel()
        p.data.copy_(flat[offset:offset + n].view_as(p))
        offset += n


@torch.no_grad()
def bn_update(loader, model, device):
    momenta = {}
    for m in model.modules():
        if isinstance(m, nn.modules.batchnorm._BatchNorm):
            m.reset_running_stats()
            momenta[m] = m.momentum
            m.momentum = None
    model.train()
    for x, _ in loader:
        model(x.to(device, non_blocking=True))
    for m, mom in momenta.items():
        m.momentum = mom


def lr_at(epoch, cfg):
    t = epoch / cfg["swa_start"]
    ratio = cfg["swa_lr"] / cfg["lr_init"]
    if t <= 0.5:
        f = 1.0
    elif t <= 0.9:
        f = 1.0 - (1.0 - ratio) * (t - 0.5) / 0.4
    else:
        f = ratio
    return cfg["lr_init"] * f


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default=None)
    ap.add_argument("--resume", default=None)
    cli = ap.parse_args()
    cfg = dict(DEFAULTS)
    if cli.config:
        with open(cli.config) as f:
            cfg.update(yaml.safe_load(f) or {})

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{local_rank}")
    torch.manual_seed(cfg["seed"])

    norm = T.Normalize((0.507, 0.487, 0.441), (0.267, 0.256, 0.276))
    train_tf = T.Compose([T.RandomCrop(32, 4), T.RandomHorizontalFlip(), T.ToTensor(), norm])
    test_tf = T.Compose([T.ToTensor(), norm])
    if rank == 0:
        torchvision.datasets.CIFAR100(cfg["data_dir"], train=True, download=True)
        torchvision.datasets.CIFAR100(cfg["data_dir"], train=False, download=True)
    dist.barrier()
    train_set = torchvision.datasets.CIFAR100(cfg["data_dir"], train=True, transform=train_tf)
    bn_set = torchvision.datasets.CIFAR100(cfg["data_dir"], train=True, transform=test_tf)
    test_set = torchvision.datasets.CIFAR100(cfg["data_dir"], train=False, transform=test_tf)

    sampler = DistributedSampler(train_set, shuffle=True, seed=cfg["seed"], drop_last=True)
    train_loader = DataLoader(train_set, batch_size=cfg["batch_size"], sampler=sampler,
                              num_workers=cfg["workers"], pin_memory=True, drop_last=True)

    model = PreResNet(56, 100)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).to(device)
    ddp = DDP(model, device_ids=[local_rank], output_device=local_rank)

    # per-GPU batch of 64 -> global batch of 64 * world; linear scaling of both LRs
    cfg["lr_init"] *= world * cfg["batch_size"] / 128
    cfg["swa_lr"] *= world * cfg["batch_size"] / 128
    opt = torch.optim.SGD(ddp.parameters(), lr=cfg["lr_init"], momentum=0.9, weight_decay=cfg["wd"])
    swag = SWAG(model, cfg["max_rank"])
    start_epoch = 0

    if cli.resume:
        ckpt = torch.load(cli.resume, map_location=device)
        model.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["opt"])
        start_epoch = ckpt["epoch"] + 1
        if ckpt.get("swag") is not None:
            s = ckpt["swag"]
            swag.mean.copy_(s["mean"]); swag.sq_mean.copy_(s["sq_mean"])
            swag.dev_cols = [c.to(device) for c in s["dev"]]
            swag.n_models = s["n_models"]

    os.makedirs(cfg["out_dir"], exist_ok=True)
    for epoch in range(start_epoch, cfg["epochs"]):
        sampler.set_epoch(epoch)
        lr = lr_at(epoch, cfg)
        for g in opt.param_groups:
            g["lr"] = lr
        ddp.train()
        t0 = time.time()
        stats = torch.zeros(3, device=device)
        for x, y in train_loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            out = ddp(x)
            loss = F.cross_entropy(out, y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            stats += torch.stack([loss.detach() * y.size(0), out.argmax(1).eq(y).sum().float(),
                                  torch.tensor(float(y.size(0)), device=device)])
        dist.all_reduce(stats)

        if epoch + 1 >= cfg["swa_start"]:
            swag.collect()  # parameters are identical on every rank after DDP steps

        if rank == 0:
            print(f"ep {epoch:3d} lr {lr:.4f} loss {stats[0] / stats[2]:.4f} "
                  f"acc {stats[1] / stats[2]:.4f} swag_n {swag.n_models} {time.time() - t0:.0f}s",
                  flush=True)
            if (epoch + 1) % 25 == 0 or epoch + 1 == cfg["epochs"]:
                torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "epoch": epoch,
                            "swag": swag.state_dict() if swag.n_models > 1 else None, "cfg": cfg},
                           os.path.join(cfg["out_dir"], "last.pt"))
        dist.barrier()

    # ------------------------------------------------------------ SWAG BMA
    # plain-BN copy: its BN layers must not talk to the other ranks while each
    # rank refreshes statistics for its own samples
    eval_net = PreResNet(56, 100).to(device)
    eval_net.load_state_dict(model.state_dict())
    state = {k: v for k, v in swag.state_dict().items()}
    bn_loader = DataLoader(bn_set, batch_size=256, shuffle=False, num_workers=cfg["workers"])
    test_loader = DataLoader(test_set, batch_size=500, shuffle=False, num_workers=cfg["workers"])
    labels = torch.tensor(test_set.targets, device=device)

    gen = torch.Generator(device=device)
    gen.manual_seed(cfg["seed"] * 7919 + rank)
    prob_sum = torch.zeros(len(test_set), 100, device=device)
    my_samples = list(range(rank, cfg["n_samples"], world))
    for s in my_samples:
        load_flat(eval_net, SWAG.sample(state, cfg["scale"], gen, device))
        bn_update(bn_loader, eval_net, device)
        eval_net.eval()
        off = 0
        with torch.no_grad():
            for x, _ in test_loader:
                p = F.softmax(eval_net(x.to(device, non_blocking=True)), dim=1)
                prob_sum[off:off + p.size(0)] += p
                off += p.size(0)
    dist.all_reduce(prob_sum)
    probs = prob_sum / cfg["n_samples"]

    if rank == 0:
        acc = probs.argmax(1).eq(labels).float().mean().item()
        nll = F.nll_loss(probs.clamp_min(1e-12).log(), labels).item()
        print(f"SWAG BMA ({cfg['n_samples']} samples): acc {acc:.4f} nll {nll:.4f}")
        torch.save({"swag": swag.state_dict(), "bma_probs": probs.cpu(), "cfg": cfg},
                   os.path.join(cfg["out_dir"], "swag_final.pt"))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
