"""QM9 property regression with SchNet (PyG), config via a dataclass + YAML overrides.

    torchrun --nproc_per_node=4 15_schnet_qm9_config_dataclass.py --config configs/schnet_alpha.yaml
"""
import argparse
import dataclasses
import json
import os
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn.functional as F
import yaml
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data.distributed import DistributedSampler
from torch_geometric.datasets import QM9
from torch_geometric.loader import DataLoader
from torch_geometric.nn.models import SchNet

QM9_TARGETS = ["mu", "alpha", "homo", "lumo", "gap", "r2", "zpve", "U0", "U", "H", "G", "Cv"]


@dataclass
class Config:
    root: str = "data/QM9"
    out_dir: str = "runs/schnet"
    target: str = "alpha"
    hidden_channels: int = 128
    num_filters: int = 128
    num_interactions: int = 6
    num_gaussians: int = 50
    cutoff: float = 10.0
    readout: str = "add"
    batch_size: int = 32
    lr: float = 1e-3
    lr_step: int = 100
    lr_gamma: float = 0.5
    epochs: int = 500
    num_workers: int = 4
    seed: int = 2024
    split: list = field(default_factory=lambda: [110000, 10000])

    @classmethod
    def load(cls, path):
        cfg = cls()
        if path:
            with open(path) as f:
                for k, v in (yaml.safe_load(f) or {}).items():
                    if not hasattr(cfg, k):
                        raise KeyError(f"unknown config key {k}")
                    setattr(cfg, k, v)
        return cfg


def build_model(cfg, mean=None, std=None):
    return SchNet(hidden_channels=cfg.hidden_channels, num_filters=cfg.num_filters,
                  num_interactions=cfg.num_interactions, num_gaussians=cfg.num_gaussians,
                  cutoff=cfg.cutoff, readout=cfg.readout, mean=mean, std=std)


@torch.no_grad()
def mae_on(net, loader, t, device):
    net.eval()
    tot = torch.zeros(2, dtype=torch.float64, device=device)
    for b in loader:
        b = b.to(device)
        tot[0] += (net(b.z, b.pos, b.batch).view(-1) - b.y[:, t]).abs().sum()
        tot[1] += b.num_graphs
    dist.all_reduce(tot)
    return (tot[0] / tot[1]).item()


def test_best(cfg, best_path, loader, t, mean, std, device):
    net = build_model(cfg, mean, std).to(device)
    net.load_state_dict(torch.load(best_path, map_location=device))
    return mae_on(net, loader, t, device)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default=None)
    cfg = Config.load(ap.parse_args().config)
    t = QM9_TARGETS.index(cfg.target)

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    if rank == 0:
        QM9(cfg.root)
        os.makedirs(cfg.out_dir, exist_ok=True)
        with open(os.path.join(cfg.out_dir, "config.json"), "w") as f:
            json.dump(dataclasses.asdict(cfg), f, indent=2)
    dist.barrier()
    ds = QM9(cfg.root)
    perm = torch.randperm(len(ds), generator=torch.Generator().manual_seed(cfg.seed))
    n_tr, n_va = cfg.split
    train_set, val_set, test_set = ds[perm[:n_tr]], ds[perm[n_tr:n_tr + n_va]], ds[perm[n_tr + n_va:]]

    y_tr = torch.stack([d.y[0, t] for d in train_set])
    mean, std = y_tr.mean().item(), y_tr.std().item()
    if cfg.readout == "add":
        n_atoms = torch.tensor([d.num_nodes for d in train_set], dtype=torch.float)
        mean, std = (y_tr / n_atoms).mean().item(), (y_tr / n_atoms).std().item()

    torch.manual_seed(cfg.seed)
    sampler = DistributedSampler(train_set, shuffle=True, seed=cfg.seed)
    train_loader = DataLoader(train_set, batch_size=cfg.batch_size, sampler=sampler,
                              num_workers=cfg.num_workers, pin_memory=True, persistent_workers=True)
    shard = lambda s: s[torch.arange(rank, len(s), world)]
    val_loader = DataLoader(shard(val_set), batch_size=256, num_workers=2)
    test_loader = DataLoader(shard(test_set), batch_size=256, num_workers=2)

    model = DDP(build_model(cfg, mean, std).to(device), device_ids=[local_rank])
    opt = torch.optim.Adam(model.parameters(), lr=cfg.lr)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=cfg.lr_step, gamma=cfg.lr_gamma)

    best_path = os.path.join(cfg.out_dir, "best.pt")
    best, history = float("inf"), []
    for epoch in range(cfg.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0, seen, run_loss = time.time(), 0, 0.0
        for b in train_loader:
            b = b.to(device, non_blocking=True)
            loss = F.l1_loss(model(b.z, b.pos, b.batch).view(-1), b.y[:, t])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            run_loss += loss.item() * b.num_graphs
            seen += b.num_graphs
        sched.step()
        tr = torch.tensor([run_loss, seen], dtype=torch.float64, device=device)
        dist.all_reduce(tr)
        train_l1 = (tr[0] / tr[1]).item()

        val = mae_on(model.module, val_loader, t, device)
        if rank == 0:
            history.append({"epoch": epoch, "train_l1": train_l1, "val_mae": val})
            print(f"[{epoch:03d}] {cfg.target} train L1 {train_l1:.5f} val MAE {val:.5f} "
                  f"{time.time() - t0:.0f}s", flush=True)
            if val < best:
                best = val
                torch.save(model.state_dict(), best_path)
        dist.barrier()

    test = test_best(cfg, best_path, test_loader, t, mean, std, device)
    if rank == 0:
        print(f"test MAE ({cfg.target}): {test:.5f}")
        with open(os.path.join(cfg.out_dir, "metrics.json"), "w") as f:
            json.dump({"best_val": best, "test": test, "history": history}, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
