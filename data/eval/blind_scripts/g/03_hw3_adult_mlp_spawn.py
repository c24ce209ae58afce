"""
HW3 Part B - data-parallel training of a tabular MLP (UCI Adult income).

Part A ran on one GPU; for part B we scale to all GPUs on the node with
torch.multiprocessing.spawn.  Usage:

    python 03_hw3_adult_mlp_spawn.py --config configs/adult_mlp.yaml

The config file holds the hyper-parameters (see configs/adult_mlp.yaml).
"""
import argparse
import os
import time

import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
import yaml
from sklearn.preprocessing import OrdinalEncoder, StandardScaler
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

CAT_COLS = ["workclass", "education", "marital-status", "occupation",
            "relationship", "race", "sex", "native-country"]
NUM_COLS = ["age", "fnlwgt", "education-num", "capital-gain", "capital-loss", "hours-per-week"]


def load_config(path):
    with open(path) as f:
        cfg = yaml.safe_load(f)
    cfg.setdefault("epochs", 20)
    cfg.setdefault("batch_size", 512)
    cfg.setdefault("lr", 3e-3)
    cfg.setdefault("emb_dim", 8)
    cfg.setdefault("hidden", [256, 128])
    cfg.setdefault("dropout", 0.2)
    cfg.setdefault("port", "29511")
    cfg.setdefault("ckpt", "checkpoints/adult_mlp.pt")
    return cfg


def preprocess(train_csv, test_csv):
    tr = pd.read_csv(train_csv, skipinitialspace=True)
    te = pd.read_csv(test_csv, skipinitialspace=True)
    tr["y"] = (tr["income"].str.strip(".") == ">50K").astype(np.int64)
    te["y"] = (te["income"].str.strip(".") == ">50K").astype(np.int64)
    enc = OrdinalEncoder(handle_unknown="use_encoded_value", unknown_value=-1)
    tr_cat = enc.fit_transform(tr[CAT_COLS]) + 1
    te_cat = enc.transform(te[CAT_COLS]) + 1
    scaler = StandardScaler()
    tr_num = scaler.fit_transform(tr[NUM_COLS])
    te_num = scaler.transform(te[NUM_COLS])
    cardinalities = [len(c) + 1 for c in enc.categories_]

    def to_ds(cat, num, y):
        return TensorDataset(torch.tensor(cat, dtype=torch.long),
                             torch.tensor(num, dtype=torch.float32),
                             torch.tensor(y, dtype=torch.long))

    return to_ds(tr_cat, tr_num, tr["y"].values), to_ds(te_cat, te_num, te["y"].values), cardinalities


class TabMLP(nn.Module):
    def __init__(self, cardinalities, n_num, emb_dim, hidden, dropout):
        super().__init__()
        self.embs = nn.ModuleList([nn.Embedding(c, emb_dim) for c in cardinalities])
        in_dim = emb_dim * len(cardinalities) + n_num
        layers = []
        for h in hidden:
            layers += [nn.Linear(in_dim, h), nn.ReLU(), nn.Dropout(dropout)]
            in_dim = h
        self.mlp = nn.Sequential(*layers)
        self.out = nn.Linear(in_dim, 2)

    def forward(self, x_cat, x_num):
        e = [emb(x_cat[:, i]) for i, emb in enumerate(self.embs)]
        x = torch.cat(e + [x_num], dim=1)
        return self.out(self.mlp(x))


def setup(rank, world_size, port):
    os.environ["MASTER_ADDR"] = "localhost"
    os.environ["MASTER_PORT"] = str(port)
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world_size)


def cleanup():
    dist.destroy_process_group()


def evaluate(model, loader, device):
    model.eval()
    stats = torch.zeros(3, device=device)  # loss_sum, correct, count
    with torch.no_grad():
        for x_cat, x_num, y in loader:
            x_cat, x_num, y = x_cat.to(device), x_num.to(device), y.to(device)
            logits = model(x_cat, x_num)
            stats[0] += F.cross_entropy(logits, y, reduction="sum")
            stats[1] += (logits.argmax(1) == y).sum()
            stats[2] += y.numel()
    dist.all_reduce(stats, op=dist.ReduceOp.SUM)
    return (stats[0] / stats[2]).item(), (stats[1] / stats[2]).item()


def train_worker(rank, world_size, config_path):
    cfg = load_config(config_path)
    setup(rank, world_size, cfg["port"])
    device = torch.device(f"cuda:{rank}")
    torch.manual_seed(0)

    train_ds, test_ds, cards = preprocess(cfg["train_csv"], cfg["test_csv"])
    train_sampler = DistributedSampler(train_ds, num_replicas=world_size, rank=rank, shuffle=True)
    # unpadded shard of the test set so that every example is counted exactly once
    test_idx = list(range(rank, len(test_ds), world_size))
    test_loader = DataLoader(torch.utils.data.Subset(test_ds, test_idx), batch_size=2048)
    per_gpu_bs = cfg["batch_size"] // world_size
    train_loader = DataLoader(train_ds, batch_size=per_gpu_bs, sampler=train_sampler,
                              num_workers=2, pin_memory=True)

    model = TabMLP(cards, len(NUM_COLS), cfg["emb_dim"], cfg["hidden"], cfg["dropout"]).to(device)
    model = DDP(model, device_ids=[rank])
    opt = torch.optim.Adam(model.parameters(), lr=cfg["lr"])
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=cfg["lr"], epochs=cfg["epochs"],
                                                steps_per_epoch=len(train_loader))

    for epoch in range(cfg["epochs"]):
        train_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for x_cat, x_num, y in train_loader:
            x_cat, x_num, y = x_cat.to(device), x_num.to(device), y.to(device)
            loss = F.cross_entropy(model(x_cat, x_num), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step()
        test_loss, test_acc = evaluate(model.module, test_loader, device)
        if rank == 0:
            print(f"epoch {epoch:02d} | train loss {loss.item():.4f} | test loss {test_loss:.4f} "
                  f"| test acc {test_acc:.4f} | {time.time() - t0:.1f}s")

    if rank == 0:
        os.makedirs(os.path.dirname(cfg["ckpt"]), exist_ok=True)
        torch.save({"model": model.module.state_dict(), "cardinalities": cards, "cfg": cfg}, cfg["ckpt"])
        print("saved", cfg["ckpt"])
    cleanup()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", default="configs/adult_mlp.yaml")
    parser.add_argument("--gpus", type=int, default=torch.cuda.device_count())
    args = parser.parse_args()
    world_size = args.gpus
    print(f"spawning {world_size} workers")
    mp.spawn(train_worker, args=(args.config, world_size), nprocs=world_size, join=True)


if __name__ == "__main__":
    main()
