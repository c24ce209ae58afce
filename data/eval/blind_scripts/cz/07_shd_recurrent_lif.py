"""Recurrent LIF network on the Spiking Heidelberg Digits (SHD), multi-GPU.

Spikes of the 700 cochlea channels are binned into T frames; a recurrent LIF
layer feeds a leaky-integrator readout whose max-over-time membrane is the logit.

    torchrun --nproc_per_node=4 07_shd_recurrent_lif.py --data-dir /data/shd --epochs 200
"""
import argparse
import dataclasses
import os
import time
from dataclasses import dataclass

import numpy as np
import tonic
import tonic.transforms as T
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Subset
from torch.utils.data.distributed import DistributedSampler


@dataclass
class Config:
    data_dir: str = "/data/shd"
    out_dir: str = "runs/shd_rlif"
    n_bins: int = 100
    hidden: int = 256
    epochs: int = 200
    batch_size: int = 64       # per GPU
    lr: float = 1e-3           # tuned for global batch 256
    tau_mem: float = 20e-3
    tau_out: float = 20e-3
    dt: float = 1e-2           # 1 s recordings / 100 bins
    reg_low: float = 1e-4      # penalise silent neurons
    reg_high: float = 1e-4     # penalise saturated layers
    workers: int = 4


class SuperSpike(torch.autograd.Function):
    scale = 100.0

    @staticmethod
    def forward(ctx, u):
        ctx.save_for_backward(u)
        return (u > 0).float()

    @staticmethod
    def backward(ctx, grad):
        (u,) = ctx.saved_tensors
        return grad / (SuperSpike.scale * u.abs() + 1.0) ** 2


class RLIFNet(nn.Module):
    def __init__(self, cfg, n_in=700, n_out=20):
        super().__init__()
        self.w_in = nn.Linear(n_in, cfg.hidden, bias=False)
        self.w_rec = nn.Linear(cfg.hidden, cfg.hidden, bias=False)
        self.w_out = nn.Linear(cfg.hidden, n_out, bias=False)
        nn.init.orthogonal_(self.w_rec.weight, gain=0.3)
        self.alpha = float(np.exp(-cfg.dt / cfg.tau_mem))
        self.kappa = float(np.exp(-cfg.dt / cfg.tau_out))

    def forward(self, x):  # x: [B, T, 700]
        B, steps, _ = x.shape
        h_in = self.w_in(x)
        u = x.new_zeros(B, self.w_rec.out_features)
        s = torch.zeros_like(u)
        y = x.new_zeros(B, self.w_out.out_features)
        ys, spikes = [], []
        for t in range(steps):
            u = self.alpha * u + h_in[:, t] + self.w_rec(s)
            s = SuperSpike.apply(u - 1.0)
            u = u - s.detach()
            y = self.kappa * y + self.w_out(s)
            ys.append(y)
            spikes.append(s)
        ys = torch.stack(ys, 1)
        spikes = torch.stack(spikes, 1)  # [B, T, H]
        return ys.max(1).values, spikes


def activity_reg(spikes, cfg):
    per_neuron = spikes.sum(1)                       # spike count per neuron per sample
    low = cfg.reg_low * F.relu(1.0 - per_neuron.mean(0)).pow(2).sum()
    high = cfg.reg_high * per_neuron.mean(1).pow(2).mean()
    return low + high


def make_datasets(cfg):
    sensor = tonic.datasets.SHD.sensor_size
    tf = T.Compose([T.ToFrame(sensor_size=sensor, n_time_bins=cfg.n_bins),
                    lambda f: np.clip(f.reshape(f.shape[0], -1), 0, 1).astype(np.float32)])
    train = tonic.datasets.SHD(save_to=cfg.data_dir, train=True, transform=tf)
    test = tonic.datasets.SHD(save_to=cfg.data_dir, train=False, transform=tf)
    return train, test


def main():
    ap = argparse.ArgumentParser()
    for f in dataclasses.fields(Config):
        ap.add_argument("--" + f.name.replace("_", "-"), type=f.type, default=f.default)
    cfg = Config(**vars(ap.parse_args()))

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(0)

    if rank == 0:
        make_datasets(cfg)  # downloads the .h5 files
    dist.barrier()
    train_set, test_set = make_datasets(cfg)

    sampler = DistributedSampler(train_set, num_replicas=world, rank=rank, shuffle=True, drop_last=True)
    train_loader = DataLoader(train_set, batch_size=cfg.batch_size, sampler=sampler,
                              num_workers=cfg.workers, pin_memory=True, drop_last=True)
    test_loader = DataLoader(Subset(test_set, list(range(rank, len(test_set), world))),
                             batch_size=256, num_workers=cfg.workers, pin_memory=True)

    model = DDP(RLIFNet(cfg).to(device), device_ids=[local_rank])
    lr = cfg.lr * (cfg.batch_size * world) / 256
    opt = torch.optim.Adamax(model.parameters(), lr=lr, betas=(0.9, 0.995))
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=50, gamma=0.5)

    if rank == 0:
        os.makedirs(cfg.out_dir, exist_ok=True)
        print(f"world {world}, global batch {cfg.batch_size * world}, lr {lr:.2e}", flush=True)

    best_acc = 0.0
    for epoch in range(cfg.epochs):
        model.train()
        t0 = time.time()
        stats = torch.zeros(4, device=device)
        for x, y in train_loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            logits, spikes = model(x)
            ce = F.cross_entropy(logits, y)
            loss = ce + activity_reg(spikes, cfg)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            stats += torch.stack([ce.detach() * len(y), (logits.argmax(1) == y).sum().float(),
                                  spikes.detach().mean() * len(y), torch.tensor(float(len(y)), device=device)])
        sched.step()
        dist.all_reduce(stats)

        net = model.module
        net.eval()
        ev = torch.zeros(2, device=device)
        with torch.no_grad():
            for x, y in test_loader:
                x, y = x.to(device), y.to(device)
                logits, _ = net(x)
                ev += torch.stack([(logits.argmax(1) == y).sum().float(), torch.tensor(float(len(y)), device=device)])
        dist.all_reduce(ev)
        test_acc = (ev[0] / ev[1]).item()

        if rank == 0:
            n = stats[3]
            print(f"epoch {epoch:3d}  ce {stats[0] / n:.4f}  train {stats[1] / n:.4f}  "
                  f"rate {stats[2] / n:.4f}  test {test_acc:.4f}  [{time.time() - t0:.1f}s]", flush=True)
            torch.save({"epoch": epoch, "model": net.state_dict(), "opt": opt.state_dict(),
                        "sched": sched.state_dict(), "cfg": dataclasses.asdict(cfg)},
                       os.path.join(cfg.out_dir, "last.pt"))
            if test_acc > best_acc:
                best_acc = test_acc
                torch.save(net.state_dict(), os.path.join(cfg.out_dir, "best_weights.pt"))

    if rank == 0:
        print(f"best test accuracy {best_acc:.4f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
