"""Molecular property regression (QM9 targets) with a GIN / PNA encoder from PyG.

    torchrun --nproc_per_node=4 09_gnn_molecule.py model=gin data.target=7 train.epochs=300
"""
import logging
import os
import time

import hydra
import torch
import torch.distributed as dist
import torch.nn as nn
from hydra.core.hydra_config import HydraConfig
from hydra.utils import instantiate, to_absolute_path
from omegaconf import DictConfig, OmegaConf
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data.distributed import DistributedSampler
from torch_geometric.datasets import QM9
from torch_geometric.loader import DataLoader
from torch_geometric.nn import global_add_pool

log = logging.getLogger(__name__)

OmegaConf.register_new_resolver("hidden_x", lambda h, k: int(h) * int(k), replace=True)


class GraphRegressor(nn.Module):
    def __init__(self, encoder, hidden_dim, num_targets=1, dropout=0.0):
        super().__init__()
        self.encoder = encoder
        self.readout = nn.Sequential(
            nn.Linear(hidden_dim, hidden_dim),
            nn.SiLU(),
            nn.Dropout(dropout),
            nn.Linear(hidden_dim, num_targets),
        )

    def forward(self, data):
        h = self.encoder(data.x, data.edge_index, edge_attr=data.edge_attr)
        return self.readout(global_add_pool(h, data.batch))


def reduce_mean(t):
    t = t.clone()
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t / dist.get_world_size()


class TargetScaler:
    def __init__(self, y):
        self.mean = y.mean(0)
        self.std = y.std(0)

    def to(self, device):
        self.mean, self.std = self.mean.to(device), self.std.to(device)
        return self

    def encode(self, y):
        return (y - self.mean) / self.std

    def decode(self, y):
        return y * self.std + self.mean


@torch.no_grad()
def evaluate(model, loader, scaler, device, target):
    model.eval()
    abs_err = torch.zeros(1, device=device)
    n = torch.zeros(1, device=device)
    for data in loader:
        data = data.to(device)
        pred = scaler.decode(model(data)).squeeze(-1)
        abs_err += (pred - data.y[:, target]).abs().sum()
        n += data.num_graphs
    dist.all_reduce(abs_err)
    dist.all_reduce(n)
    model.train()
    return (abs_err / n).item()


@hydra.main(version_base="1.3", config_path="configs", config_name="qm9")
def main(cfg: DictConfig):
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    torch.manual_seed(cfg.seed)
    out_dir = HydraConfig.get().runtime.output_dir

    # the processed/ folder was built once offline (scripts/prepare_qm9.py)
    dataset = QM9(to_absolute_path(cfg.data.root))
    g = torch.Generator().manual_seed(cfg.data.split_seed)
    perm = torch.randperm(len(dataset), generator=g)
    test_idx = perm[: cfg.data.n_test]
    val_idx = perm[cfg.data.n_test: cfg.data.n_test + cfg.data.n_val]
    train_idx = perm[cfg.data.n_test + cfg.data.n_val:]
    train_ds, val_ds, test_ds = dataset[train_idx], dataset[val_idx], dataset[test_idx]

    scaler = TargetScaler(train_ds.y[:, cfg.data.target]).to(device)

    train_sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    val_sampler = DistributedSampler(val_ds, shuffle=False)
    test_sampler = DistributedSampler(test_ds, shuffle=False)
    train_loader = DataLoader(train_ds, batch_size=cfg.train.batch_size, sampler=train_sampler,
                              num_workers=cfg.data.workers, drop_last=True)
    val_loader = DataLoader(val_ds, batch_size=cfg.train.batch_size, sampler=val_sampler,
                            num_workers=cfg.data.workers)
    test_loader = DataLoader(test_ds, batch_size=cfg.train.batch_size, sampler=test_sampler,
                             num_workers=cfg.data.workers)

    encoder = instantiate(cfg.model.encoder, in_channels=dataset.num_features)
    model = GraphRegressor(encoder, cfg.model.hidden_dim, dropout=cfg.model.dropout).to(device)
    model = DDP(model, device_ids=[local_rank])

    optimizer = instantiate(cfg.optim, params=model.parameters())
    scheduler = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, mode="min", factor=0.7,
                                                           patience=cfg.train.patience, min_lr=1e-6)
    criterion = nn.L1Loss()

    best_val, test_at_best = float("inf"), float("inf")
    step = 0
    for epoch in range(1, cfg.train.epochs + 1):
        train_sampler.set_epoch(epoch)
        t0 = time.time()
        for data in train_loader:
            data = data.to(device, non_blocking=True)
            pred = model(data).squeeze(-1)
            loss = criterion(pred, scaler.encode(data.y[:, cfg.data.target]))
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), cfg.train.clip)
            optimizer.step()
            step += 1
            if rank == 0 and step % cfg.train.log_every == 0:
                avg = reduce_mean(loss.detach())
                log.info("epoch %d step %d loss(avg over ranks) %.5f", epoch, step, avg.item())

        val_mae = evaluate(model, val_loader, scaler, device, cfg.data.target)
        scheduler.step(val_mae)
        if val_mae < best_val:
            best_val = val_mae
            test_at_best = evaluate(model, test_loader, scaler, device, cfg.data.target)
            if rank == 0:
                torch.save({"model": model.module.state_dict(), "epoch": epoch, "val_mae": val_mae,
                            "scaler": (scaler.mean.cpu(), scaler.std.cpu())},
                           os.path.join(out_dir, "best.pt"))
        if rank == 0:
            log.info("epoch %d (%.1fs) val MAE %.5f best %.5f test@best %.5f lr %.2e", epoch, time.time() - t0,
                     val_mae, best_val, test_at_best, optimizer.param_groups[0]["lr"])
        if optimizer.param_groups[0]["lr"] <= 1e-6 + 1e-12:
            break

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
