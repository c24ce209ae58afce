"""DVS128 Gesture with a stateful LIF CNN (single-step neurons, explicit state reset).

Launch:
    torchrun --standalone --nproc_per_node=8 02_dvsgesture_stateful_lif.py --config cfg/gesture.yaml
"""
import argparse
import math
import os
import time

import numpy as np
import tonic
import tonic.transforms as tt
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import yaml
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

DEFAULTS = dict(
    data_root="/datasets/tonic",
    out_dir="checkpoints/gesture_lif",
    time_bins=16,
    epochs=80,
    batch_size=16,  # per GPU
    base_lr=2e-3,   # for a global batch of 128
    weight_decay=5e-4,
    warmup_epochs=3,
    tau=2.0,
    rate_reg=0.02,
    workers=8,
)


def is_main():
    return dist.get_rank() == 0


def print0(*a, **kw):
    if is_main():
        print(*a, **kw, flush=True)


class Atan(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, alpha=2.0):
        ctx.save_for_backward(x)
        ctx.alpha = alpha
        return (x >= 0).float()

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        a = ctx.alpha
        return g * (a / 2) / (1 + (math.pi / 2 * a * x) ** 2), None


class LIFNode(nn.Module):
    """Single-step LIF; the membrane lives on the module between calls."""

    def __init__(self, tau=2.0, v_th=1.0):
        super().__init__()
        self.tau, self.v_th = tau, v_th
        self.v = None
        self.spike_count = 0.0
        self.n_calls = 0

    def reset(self):
        self.v = None
        self.spike_count = 0.0
        self.n_calls = 0

    def forward(self, x):
        if self.v is None:
            self.v = torch.zeros_like(x)
        self.v = self.v + (x - self.v) / self.tau
        s = Atan.apply(self.v - self.v_th)
        self.v = self.v * (1.0 - s.detach())  # hard reset to 0
        self.spike_count = self.spike_count + s.mean()
        self.n_calls += 1
        return s


class GestureNet(nn.Module):
    def __init__(self, tau, channels=64, num_classes=11):
        super().__init__()
        blocks = []
        c_in = 2
        for _ in range(4):
            blocks += [nn.Conv2d(c_in, channels, 3, padding=1, bias=False),
                       nn.GroupNorm(8, channels), LIFNode(tau), nn.AvgPool2d(2)]
            c_in = channels
        self.features = nn.Sequential(*blocks)
        self.fc1 = nn.Linear(channels * 4 * 4, 256)
        self.lif_fc = LIFNode(tau)
        self.fc2 = nn.Linear(256, num_classes)

    def lif_nodes(self):
        return [m for m in self.modules() if isinstance(m, LIFNode)]

    def reset_states(self):
        for m in self.lif_nodes():
            m.reset()

    def mean_rate(self):
        nodes = self.lif_nodes()
        return sum(m.spike_count / max(m.n_calls, 1) for m in nodes) / len(nodes)

    def forward(self, frames):  # frames: [B, T, 2, 64, 64]
        out = 0.0
        for t in range(frames.shape[1]):
            h = self.features(frames[:, t])
            h = self.lif_fc(self.fc1(h.flatten(1)))
            out = out + self.fc2(h)
        return out / frames.shape[1]


def build_transform(T):
    return tt.Compose([
        tt.Denoise(filter_time=10000),
        tt.Downsample(spatial_factor=0.5),
        tt.ToFrame(sensor_size=(64, 64, 2), n_time_bins=T),
        lambda f: np.clip(f, 0, 8).astype(np.float32) / 8.0,
    ])


def build_datasets(cfg):
    tf = build_transform(cfg["time_bins"])
    train = tonic.datasets.DVSGesture(save_to=cfg["data_root"], train=True, transform=tf)
    test = tonic.datasets.DVSGesture(save_to=cfg["data_root"], train=False, transform=tf)
    return train, test


def lr_at(epoch_float, cfg, peak):
    if epoch_float < cfg["warmup_epochs"]:
        return peak * epoch_float / cfg["warmup_epochs"]
    prog = (epoch_float - cfg["warmup_epochs"]) / max(cfg["epochs"] - cfg["warmup_epochs"], 1)
    return 0.5 * peak * (1 + math.cos(math.pi * prog))


@torch.no_grad()
def evaluate(net, loader, device, n_total):
    net.eval()
    correct = torch.zeros(1, device=device, dtype=torch.long)
    seen = torch.zeros(1, device=device, dtype=torch.long)
    for frames, y in loader:
        frames, y = frames.to(device), y.to(device)
        net.reset_states()
        pred = net(frames).argmax(1)
        correct += (pred == y).sum()
        seen += y.numel()
    dist.all_reduce(correct)
    dist.all_reduce(seen)
    assert seen.item() == n_total, (seen.item(), n_total)
    return correct.item() / n_total


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
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{local_rank}")
    torch.manual_seed(0)

    # tonic downloads and extracts on first use: let rank 0 do that alone
    if rank == 0:
        train_set, test_set = build_datasets(cfg)
    dist.barrier()
    if rank != 0:
        train_set, test_set = build_datasets(cfg)

    sampler = DistributedSampler(train_set, shuffle=True, drop_last=True)
    train_loader = DataLoader(train_set, batch_size=cfg["batch_size"], sampler=sampler,
                              num_workers=cfg["workers"], pin_memory=True, drop_last=True)
    test_idx = list(range(rank, len(test_set), world))
    test_loader = DataLoader(torch.utils.data.Subset(test_set, test_idx), batch_size=32,
                             num_workers=cfg["workers"], pin_memory=True)

    model = DDP(GestureNet(cfg["tau"]).to(device), device_ids=[local_rank])
    peak_lr = cfg["base_lr"] * cfg["batch_size"] * world / 128
    opt = torch.optim.AdamW(model.parameters(), lr=peak_lr, weight_decay=cfg["weight_decay"])

    start, best = 0, 0.0
    if cli.resume:
        ck = torch.load(cli.resume, map_location=device)
        model.module.load_state_dict(ck["model"])
        opt.load_state_dict(ck["opt"])
        start, best = ck["epoch"] + 1, ck.get("best", 0.0)
    os.makedirs(cfg["out_dir"], exist_ok=True)

    steps_per_epoch = len(train_loader)
    for epoch in range(start, cfg["epochs"]):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        loss_sum = torch.zeros(1, device=device)
        for it, (frames, y) in enumerate(train_loader):
            for g in opt.param_groups:
                g["lr"] = lr_at(epoch + it / steps_per_epoch, cfg, peak_lr)
            frames = frames.to(device, non_blocking=True)
            y = y.to(device, non_blocking=True)

            model.reset_states()
            logits = model(frames)
            rate = model.module.mean_rate()
            loss = F.cross_entropy(logits, y, label_smoothing=0.1) + cfg["rate_reg"] * rate

            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            loss_sum += loss.detach()

        dist.all_reduce(loss_sum)
        train_loss = loss_sum.item() / (world * steps_per_epoch)
        acc = evaluate(model.module, test_loader, device, len(test_set))
        print0(f"[{epoch:03d}] loss {train_loss:.4f}  test acc {acc * 100:.2f}%  "
               f"lr {opt.param_groups[0]['lr']:.2e}  {time.time() - t0:.0f}s")

        if is_main():
            ck = {"model": model.module.state_dict(), "opt": opt.state_dict(),
                  "epoch": epoch, "best": max(best, acc), "cfg": cfg}
            torch.save(ck, os.path.join(cfg["out_dir"], "last.pth"))
            if acc > best:
                torch.save(ck, os.path.join(cfg["out_dir"], "best.pth"))
        best = max(best, acc)

    print0(f"done, best test acc {best * 100:.2f}%")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
