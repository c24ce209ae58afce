# Recurrent SNN on the Spiking Heidelberg Digits (SHD) with snnTorch.
#
#   torchrun --nproc_per_node=4 03_shd_recurrent_snntorch.py --config configs/shd_rsnn.yaml
#
# Readout is the max-over-time membrane potential of a non-spiking output layer.
import argparse
import logging
import os
import random
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import yaml
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

import snntorch as snn
from snntorch import surrogate
import tonic
import tonic.transforms as T

logger = logging.getLogger(__name__)


@dataclass
class Config:
    data_root: str = "/data/shd"
    out_dir: str = "checkpoints/shd_rsnn"
    n_bins: int = 100
    n_channels: int = 700
    downsample: int = 5          # 700 -> 140 input channels
    hidden: int = 256
    beta: float = 0.95
    slope: float = 25.0
    dropout: float = 0.1
    batch_size: int = 128        # per GPU
    epochs: int = 150
    lr: float = 2e-3
    weight_decay: float = 1e-5
    workers: int = 4
    seed: int = 1234
    log_every: int = 20
    milestones: list = field(default_factory=lambda: [80, 120])


def load_config(path):
    cfg = Config()
    if path:
        with open(path) as f:
            for k, v in yaml.safe_load(f).items():
                if not hasattr(cfg, k):
                    raise KeyError(f"unknown config key {k}")
                setattr(cfg, k, v)
    return cfg


def seed_everything(seed):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


class RSNN(nn.Module):
    def __init__(self, n_in, hidden, n_out, beta, slope, dropout):
        super().__init__()
        spike_grad = surrogate.fast_sigmoid(slope=slope)
        self.fc_in = nn.Linear(n_in, hidden)
        self.rlif = snn.RLeaky(beta=beta, linear_features=hidden, spike_grad=spike_grad,
                               learn_beta=True, all_to_all=True)
        self.drop = nn.Dropout(dropout)
        self.fc_out = nn.Linear(hidden, n_out)
        self.readout = snn.Leaky(beta=beta, spike_grad=spike_grad, reset_mechanism="none", learn_beta=True)

    def forward(self, x):
        # x: [T, B, n_in]; hidden states start from zero for every batch
        spk, mem = self.rlif.init_rleaky()
        mem_out = self.readout.init_leaky()
        mem_rec = []
        for t in range(x.size(0)):
            cur = self.fc_in(x[t])
            spk, mem = self.rlif(cur, spk, mem)
            _, mem_out = self.readout(self.fc_out(self.drop(spk)), mem_out)
            mem_rec.append(mem_out)
        return torch.stack(mem_rec).max(0).values


def build_datasets(cfg):
    sensor_size = tonic.datasets.SHD.sensor_size
    transform = T.Compose([
        T.Downsample(spatial_factor=1.0 / cfg.downsample),
        T.ToFrame(sensor_size=(cfg.n_channels // cfg.downsample, 1, 1), n_time_bins=cfg.n_bins),
    ])
    train = tonic.datasets.SHD(save_to=cfg.data_root, train=True, transform=transform)
    test = tonic.datasets.SHD(save_to=cfg.data_root, train=False, transform=transform)
    return train, test


def collate(batch):
    frames = torch.stack([torch.as_tensor(f, dtype=torch.float32).flatten(1) for f, _ in batch], dim=1)
    labels = torch.as_tensor([l for _, l in batch], dtype=torch.long)
    return frames, labels  # [T, B, C], [B]


def train_one_epoch(model, loader, optimizer, device, epoch, cfg, rank):
    model.train()
    for step, (x, y) in enumerate(loader):
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        logits = model(x)
        loss = F.cross_entropy(logits, y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        if rank == 0 and step % cfg.log_every == 0:
            logger.info("epoch %d step %d/%d loss %.4f (rank 0)", epoch, step, len(loader), loss.item())


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    correct, total, loss_sum = 0, 0, 0.0
    for x, y in loader:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        logits = model(x)
        loss_sum += F.cross_entropy(logits, y, reduction="sum").item()
        correct += (logits.argmax(1) == y).sum().item()
        total += y.numel()
    return correct / total, loss_sum / total


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="")
    args = ap.parse_args()
    cfg = load_config(args.config)

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank = dist.get_rank()
    world_size = dist.get_world_size()
    device = torch.device(f"cuda:{local_rank}")

    logging.basicConfig(level=logging.INFO if rank == 0 else logging.ERROR,
                        format="[%(asctime)s] %(message)s")
    seed_everything(cfg.seed)

    if rank == 0:
        # downloads + extracts the h5 files once
        build_datasets(cfg)
    dist.barrier()
    train_set, test_set = build_datasets(cfg)

    train_sampler = DistributedSampler(train_set, shuffle=True, drop_last=True)
    test_sampler = DistributedSampler(test_set, shuffle=False)
    train_loader = DataLoader(train_set, batch_size=cfg.batch_size, sampler=train_sampler,
                              collate_fn=collate, num_workers=cfg.workers, pin_memory=True, drop_last=True)
    test_loader = DataLoader(test_set, batch_size=cfg.batch_size, sampler=test_sampler,
                             collate_fn=collate, num_workers=cfg.workers, pin_memory=True)

    model = RSNN(cfg.n_channels // cfg.downsample, cfg.hidden, 20, cfg.beta, cfg.slope, cfg.dropout).to(device)
    model = DDP(model, device_ids=[local_rank], output_device=local_rank)
    optimizer = torch.optim.Adam(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    scheduler = torch.optim.lr_scheduler.MultiStepLR(optimizer, milestones=cfg.milestones, gamma=0.3)

    if rank == 0:
        os.makedirs(cfg.out_dir, exist_ok=True)
        logger.info("world size %d, %d train / %d test samples", world_size, len(train_set), len(test_set))

    best_acc = 0.0
    for epoch in range(cfg.epochs):
        train_sampler.set_epoch(epoch)
        train_one_epoch(model, train_loader, optimizer, device, epoch, cfg, rank)
        scheduler.step()

        test_acc, test_loss = evaluate(model, test_loader, device)
        if rank == 0:
            logger.info("epoch %d  test loss %.4f  test acc %.2f%%", epoch, test_loss, 100 * test_acc)
            state = {"epoch": epoch, "model": model.module.state_dict(),
                     "optimizer": optimizer.state_dict(), "test_acc": test_acc, "cfg": cfg.__dict__}
            torch.save(state, os.path.join(cfg.out_dir, "last.pt"))
            if test_acc > best_acc:
                best_acc = test_acc
                torch.save(state, os.path.join(cfg.out_dir, "best.pt"))
                logger.info("new best %.2f%%", 100 * best_acc)

    if rank == 0:
        logger.info("done, best test acc %.2f%%", 100 * best_acc)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
