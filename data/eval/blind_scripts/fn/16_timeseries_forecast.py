"""Long-horizon multivariate forecasting (PatchTST-style) on the ETT / Electricity / Traffic benchmarks.

    torchrun --nproc_per_node=4 16_timeseries_forecast.py data=electricity model.patch_len=16 data.pred_len=96,192 -m
"""
import copy
import logging
import os

import hydra
import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
import torch.nn as nn
from hydra.core.hydra_config import HydraConfig
from hydra.utils import instantiate, to_absolute_path
from omegaconf import DictConfig, OmegaConf
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

log = logging.getLogger(__name__)

OmegaConf.register_new_resolver("n_patches", lambda seq, p, s: (seq - p) // s + 2, replace=True)


class WindowDataset(Dataset):
    """Sliding windows over a (T, C) array; standardised with statistics of the train part."""

    def __init__(self, csv_path, split, seq_len, pred_len, borders):
        df = pd.read_csv(csv_path)
        values = df.drop(columns=["date"]).values.astype(np.float32)
        b1, b2 = borders[split]
        train_b1, train_b2 = borders["train"]
        train_part = values[train_b1:train_b2]
        self.mean = train_part.mean(0)
        self.std = train_part.std(0) + 1e-5
        start = b1 - seq_len if split != "train" else b1
        self.data = (values[start:b2] - self.mean) / self.std
        self.seq_len, self.pred_len = seq_len, pred_len

    def __len__(self):
        return len(self.data) - self.seq_len - self.pred_len + 1

    def __getitem__(self, i):
        x = self.data[i:i + self.seq_len]
        y = self.data[i + self.seq_len:i + self.seq_len + self.pred_len]
        return torch.from_numpy(x), torch.from_numpy(y)


def compute_borders(n, seq_len, ratios=(0.7, 0.1, 0.2)):
    n_train = int(n * ratios[0])
    n_test = int(n * ratios[2])
    n_val = n - n_train - n_test
    return {"train": (0, n_train), "val": (n_train, n_train + n_val), "test": (n - n_test, n)}


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    se, ae, count = 0.0, 0.0, 0
    for x, y in loader:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        pred = model(x)
        se += ((pred - y) ** 2).sum().item()
        ae += (pred - y).abs().sum().item()
        count += y.numel()
    model.train()
    return se / count, ae / count


def make_loader(ds, batch_size, train, workers):
    sampler = DistributedSampler(ds, shuffle=train, drop_last=train)
    return DataLoader(ds, batch_size=batch_size, sampler=sampler, num_workers=workers,
                      pin_memory=True, drop_last=train), sampler


@hydra.main(version_base="1.3", config_path="configs", config_name="forecast")
def main(cfg: DictConfig):
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    torch.manual_seed(cfg.seed)
    np.random.seed(cfg.seed)
    out_dir = HydraConfig.get().runtime.output_dir

    csv_path = to_absolute_path(cfg.data.csv)
    n_rows = sum(1 for _ in open(csv_path)) - 1
    borders = compute_borders(n_rows, cfg.data.seq_len)
    sets = {s: WindowDataset(csv_path, s, cfg.data.seq_len, cfg.data.pred_len, borders) for s in ("train", "val", "test")}
    train_loader, train_sampler = make_loader(sets["train"], cfg.train.batch_size, True, cfg.data.workers)
    val_loader, _ = make_loader(sets["val"], cfg.train.eval_batch_size, False, cfg.data.workers)
    test_loader, _ = make_loader(sets["test"], cfg.train.eval_batch_size, False, cfg.data.workers)

    model = instantiate(cfg.model, n_vars=cfg.data.n_vars, seq_len=cfg.data.seq_len,
                        pred_len=cfg.data.pred_len).to(device)
    model = DDP(model, device_ids=[local_rank])
    optimizer = instantiate(cfg.optim, params=model.parameters())
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=cfg.optim.lr, pct_start=0.3,
                                                    total_steps=cfg.train.epochs * len(train_loader))
    criterion = nn.MSELoss()

    best_val, best_state = float("inf"), None
    best_path = os.path.join(out_dir, "checkpoint.pth")
    patience_left = cfg.train.patience
    for epoch in range(cfg.train.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        train_loss = torch.zeros(2, device=device)
        for x, y in train_loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            loss = criterion(model(x), y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            scheduler.step()
            train_loss += torch.stack([loss.detach() * x.size(0), torch.tensor(float(x.size(0)), device=device)])
        dist.all_reduce(train_loss)

        val_mse, val_mae = evaluate(model, val_loader, device)
        if rank == 0:
            log.info("epoch %d train %.4f val mse %.4f mae %.4f", epoch,
                     (train_loss[0] / train_loss[1]).item(), val_mse, val_mae)
        if val_mse < best_val:
            best_val = val_mse
            best_state = copy.deepcopy(model.module.state_dict())
            patience_left = cfg.train.patience
        else:
            patience_left -= 1
        stop = torch.tensor([1.0 if patience_left <= 0 else 0.0], device=device)
        dist.all_reduce(stop, op=dist.ReduceOp.MAX)
        if stop.item() > 0:
            if rank == 0:
                log.info("early stopping at epoch %d", epoch)
            break

    model.module.load_state_dict(best_state)
    test_mse, test_mae = evaluate(model, test_loader, device)
    if rank == 0:
        torch.save(best_state, best_path)
        log.info("TEST pred_len=%d  mse %.4f  mae %.4f", cfg.data.pred_len, test_mse, test_mae)
        with open(os.path.join(out_dir, "metrics.txt"), "w") as f:
            f.write(f"mse {test_mse:.6f}\nmae {test_mae:.6f}\n")
    dist.destroy_process_group()
    return test_mse


if __name__ == "__main__":
    main()
