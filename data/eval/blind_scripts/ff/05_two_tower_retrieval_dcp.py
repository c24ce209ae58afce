"""Two-tower retrieval model with TorchRec, in-batch negatives over the global batch.

User and item id tables are row-wise sharded (they do not fit on one GPU),
the small side tables are table-wise. Towers are data parallel (DMP wraps
them in DDP). Checkpoints use torch.distributed.checkpoint, so a run can be
resumed on a different number of GPUs.

torchrun --nnodes=4 --nproc_per_node=8 --rdzv_backend=c10d --rdzv_endpoint=$HEAD:29500 \
    05_two_tower_retrieval_dcp.py --config configs/tt_v3.yaml
"""
import argparse
import json
import os
import time

import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.distributed.nn.functional as dist_nn
import torch.nn as nn
import torch.nn.functional as F
import wandb
import yaml
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor
from torchrec.distributed.comm import get_local_size
from torchrec.distributed.model_parallel import DistributedModelParallel, get_default_sharders
from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints, Topology
from torchrec.distributed.types import ShardingType
from torchrec.modules.mlp import MLP
from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper
from torchrec.optim.optimizers import in_backward_optimizer_filter

DEFAULTS = {
    "data": "/mnt/shared/interactions/2024w10.parquet",
    "val_data": "/mnt/shared/interactions/2024w11_sample.parquet",
    "ckpt_dir": "/mnt/shared/ckpt/two_tower",
    "batch_size": 1024,
    "emb_dim": 128,
    "tower_layers": [512, 256, 128],
    "temperature": 0.05,
    "dense_lr": 5e-4,
    "sparse_lr": 0.05,
    "epochs": 4,
    "workers": 4,
    "tables": {
        "user_id": {"rows": 120_000_000, "features": ["user_id"], "sharding": "row_wise"},
        "item_id": {"rows": 30_000_000, "features": ["item_id"], "sharding": "row_wise"},
        "country": {"rows": 256, "features": ["user_country"], "sharding": "table_wise"},
        "age": {"rows": 16, "features": ["user_age_bucket"], "sharding": "table_wise"},
        "category": {"rows": 20_000, "features": ["item_category"], "sharding": "table_wise"},
        "brand": {"rows": 800_000, "features": ["item_brand"], "sharding": "table_wise"},
    },
    "query_features": ["user_id", "user_country", "user_age_bucket"],
    "item_features": ["item_id", "item_category", "item_brand"],
}


def load_config():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default=None)
    ap.add_argument("--wandb_project", default="retrieval-two-tower")
    args = ap.parse_args()
    cfg = dict(DEFAULTS)
    if args.config:
        with open(args.config) as f:
            cfg.update(yaml.safe_load(f) or {})
    cfg["wandb_project"] = args.wandb_project
    return cfg


class Interactions(Dataset):
    def __init__(self, path, keys):
        df = pd.read_parquet(path, columns=keys)
        self.ids = df[keys].to_numpy(dtype=np.int64)

    def __len__(self):
        return self.ids.shape[0]

    def __getitem__(self, i):
        return self.ids[i]


def make_collate(keys):
    def collate(rows):
        ids = torch.from_numpy(np.stack(rows))
        return KeyedJaggedTensor.from_lengths_sync(
            keys=keys,
            values=ids.t().contiguous().view(-1),
            lengths=torch.ones(ids.numel(), dtype=torch.int32),
        )

    return collate


class TwoTower(nn.Module):
    def __init__(self, cfg, device):
        super().__init__()
        d = cfg["emb_dim"]
        self.query_features = cfg["query_features"]
        self.item_features = cfg["item_features"]
        self.ebc = EmbeddingBagCollection(
            tables=[
                EmbeddingBagConfig(name=n, embedding_dim=d, num_embeddings=t["rows"], feature_names=t["features"])
                for n, t in cfg["tables"].items()
            ],
            device=torch.device("meta"),
        )
        self.query_tower = MLP(d * len(self.query_features), cfg["tower_layers"], device=device)
        self.item_tower = MLP(d * len(self.item_features), cfg["tower_layers"], device=device)

    def forward(self, kjt):
        pooled = self.ebc(kjt).to_dict()
        q = self.query_tower(torch.cat([pooled[f] for f in self.query_features], dim=1))
        c = self.item_tower(torch.cat([pooled[f] for f in self.item_features], dim=1))
        return F.normalize(q, dim=-1), F.normalize(c, dim=-1)


def global_inbatch_loss(q, c, temperature):
    # differentiable all_gather: the gradient w.r.t. the other ranks' items flows back to them
    all_c = torch.cat(dist_nn.all_gather(c), dim=0)
    logits = q @ all_c.t() / temperature
    target = torch.arange(q.size(0), device=q.device) + dist.get_rank() * q.size(0)
    return F.cross_entropy(logits, target), logits, target


def build(cfg, device):
    model = TwoTower(cfg, device)
    apply_optimizer_in_backward(torch.optim.Adagrad, model.ebc.parameters(), {"lr": cfg["sparse_lr"]})
    kinds = {"row_wise": ShardingType.ROW_WISE.value, "table_wise": ShardingType.TABLE_WISE.value}
    constraints = {n: ParameterConstraints(sharding_types=[kinds[t["sharding"]]]) for n, t in cfg["tables"].items()}
    planner = EmbeddingShardingPlanner(
        topology=Topology(world_size=dist.get_world_size(), local_world_size=get_local_size(), compute_device="cuda"),
        batch_size=cfg["batch_size"],
        constraints=constraints,
    )
    plan = planner.collective_plan(model, get_default_sharders(), dist.GroupMember.WORLD)
    dmp = DistributedModelParallel(model, device=device, plan=plan)
    dense_opt = KeyedOptimizerWrapper(
        dict(in_backward_optimizer_filter(dmp.named_parameters())),
        lambda ps: torch.optim.AdamW(ps, lr=cfg["dense_lr"], weight_decay=1e-5),
    )
    return dmp, CombinedOptimizer([dmp.fused_optimizer, dense_opt])


@torch.no_grad()
def evaluate(model, loader, cfg, device):
    model.eval()
    stats = torch.zeros(3, device=device)  # loss sum, hits@50, count
    for kjt in loader:
        q, c = model(kjt.to(device, non_blocking=True))
        loss, logits, target = global_inbatch_loss(q, c, cfg["temperature"])
        top = logits.topk(50, dim=1).indices
        stats[0] += loss * q.size(0)
        stats[1] += (top == target[:, None]).any(dim=1).sum()
        stats[2] += q.size(0)
    dist.all_reduce(stats)
    model.train()
    return (stats[0] / stats[2]).item(), (stats[1] / stats[2]).item()


def checkpoint_paths(cfg, epoch):
    return os.path.join(cfg["ckpt_dir"], f"epoch_{epoch:03d}"), os.path.join(cfg["ckpt_dir"], "latest.json")


def main():
    cfg = load_config()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()

    keys = cfg["query_features"] + cfg["item_features"]
    train_ds = Interactions(cfg["data"], keys)
    val_ds = Interactions(cfg["val_data"], keys)
    train_sampler = DistributedSampler(train_ds, shuffle=True, seed=0, drop_last=True)
    val_sampler = DistributedSampler(val_ds, shuffle=False, drop_last=True)
    collate = make_collate(keys)
    train_loader = DataLoader(train_ds, batch_size=cfg["batch_size"], sampler=train_sampler, drop_last=True,
                              collate_fn=collate, num_workers=cfg["workers"], pin_memory=True)
    val_loader = DataLoader(val_ds, batch_size=cfg["batch_size"], sampler=val_sampler, drop_last=True,
                            collate_fn=collate, num_workers=cfg["workers"], pin_memory=True)

    model, optimizer = build(cfg, device)

    start_epoch = 0
    latest = os.path.join(cfg["ckpt_dir"], "latest.json")
    if os.path.exists(latest):
        with open(latest) as f:
            meta = json.load(f)
        state = {"model": model.state_dict(), "optim": optimizer.state_dict()}
        dcp.load(state, checkpoint_id=meta["path"])
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optim"])
        start_epoch = meta["epoch"] + 1
        if rank == 0:
            print(f"resumed {meta['path']} (saved with world size {meta['world_size']}, now {world})")

    run = None
    if rank == 0:
        run = wandb.init(project=cfg["wandb_project"], config={**cfg, "world_size": world})

    step = start_epoch * len(train_loader)
    for epoch in range(start_epoch, cfg["epochs"]):
        train_sampler.set_epoch(epoch)
        t0 = time.time()
        for kjt in train_loader:
            q, c = model(kjt.to(device, non_blocking=True))
            loss, _, _ = global_inbatch_loss(q, c, cfg["temperature"])
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            step += 1
            if run is not None and step % 100 == 0:
                run.log({"train/loss": loss.item(), "train/steps_per_s": 100 / (time.time() - t0)}, step=step)
                t0 = time.time()

        val_loss, recall = evaluate(model, val_loader, cfg, device)
        if run is not None:
            run.log({"val/loss": val_loss, "val/inbatch_recall@50": recall}, step=step)

        path, latest = checkpoint_paths(cfg, epoch)
        dcp.save({"model": model.state_dict(), "optim": optimizer.state_dict()}, checkpoint_id=path)
        dist.barrier()
        if rank == 0:
            with open(latest + ".tmp", "w") as f:
                json.dump({"path": path, "epoch": epoch, "world_size": world}, f)
            os.replace(latest + ".tmp", latest)

    if run is not None:
        run.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
