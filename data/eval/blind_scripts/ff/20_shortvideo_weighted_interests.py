"""Short-video watch prediction with TorchRec: id features plus weighted
interest-tag features (tag id + affinity score per user).

Two EmbeddingBagCollections (plain and weighted) are sharded by the same plan;
the MLP is data parallel. Logged to W&B from rank 0.

torchrun --nproc_per_node=8 20_shortvideo_weighted_interests.py --data /datasets/sv_logs/2024-06
"""
import argparse
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
import torch.nn.functional as F
import wandb
from torch.utils.data import DataLoader, Dataset
from torchmetrics.classification import BinaryAUROC
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor
from torchrec.distributed.comm import get_local_size
from torchrec.distributed.model_parallel import DistributedModelParallel, get_default_sharders
from torchrec.distributed.planner import EmbeddingShardingPlanner, Topology
from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper
from torchrec.optim.optimizers import in_backward_optimizer_filter

ID_FEATURES = {"user_id": 40_000_000, "video_id": 15_000_000, "author_id": 3_000_000,
               "music_id": 1_000_000, "province": 40, "device_brand": 300}
TAG_FEATURES = {"user_interest_tags": 200_000, "video_tags": 200_000}
MAX_TAGS = 32
NUM_DENSE = 8


class WatchLogs(Dataset):
    def __init__(self, root, split):
        z = np.load(os.path.join(root, f"{split}.npz"))
        self.ids = z["ids"]                      # [N, len(ID_FEATURES)]
        self.tags = z["tags"]                    # [N, len(TAG_FEATURES), MAX_TAGS], -1 = empty
        self.tag_w = z["tag_weights"]            # [N, len(TAG_FEATURES), MAX_TAGS]
        self.dense = z["dense"].astype(np.float32)
        self.label = z["long_view"].astype(np.float32)

    def __len__(self):
        return len(self.label)

    def __getitem__(self, i):
        return self.ids[i], self.tags[i], self.tag_w[i], self.dense[i], self.label[i]


def collate(rows):
    b = len(rows)
    ids = np.stack([r[0] for r in rows]).astype(np.int64)
    id_kjt = KeyedJaggedTensor.from_lengths_sync(
        keys=list(ID_FEATURES), values=torch.from_numpy(ids.T.reshape(-1)),
        lengths=torch.ones(b * len(ID_FEATURES), dtype=torch.int32),
    )
    tags = np.stack([r[1] for r in rows]).transpose(1, 0, 2)     # [F, B, T]
    weights = np.stack([r[2] for r in rows]).transpose(1, 0, 2)
    valid = tags >= 0
    tag_kjt = KeyedJaggedTensor.from_lengths_sync(
        keys=list(TAG_FEATURES),
        values=torch.from_numpy(tags[valid].astype(np.int64)),
        lengths=torch.from_numpy(valid.sum(-1).reshape(-1).astype(np.int32)),
        weights=torch.from_numpy(weights[valid].astype(np.float32)),
    )
    dense = torch.from_numpy(np.stack([r[3] for r in rows]))
    labels = torch.from_numpy(np.array([r[4] for r in rows], dtype=np.float32))
    return id_kjt, tag_kjt, dense, labels


class WatchModel(nn.Module):
    def __init__(self, dim, device):
        super().__init__()
        self.id_ebc = EmbeddingBagCollection(
            tables=[EmbeddingBagConfig(name=f"id_{k}", embedding_dim=dim, num_embeddings=n, feature_names=[k])
                    for k, n in ID_FEATURES.items()],
            device=torch.device("meta"),
        )
        self.tag_ebc = EmbeddingBagCollection(
            tables=[EmbeddingBagConfig(name=f"tag_{k}", embedding_dim=dim, num_embeddings=n, feature_names=[k])
                    for k, n in TAG_FEATURES.items()],
            is_weighted=True,
            device=torch.device("meta"),
        )
        n_in = dim * (len(ID_FEATURES) + len(TAG_FEATURES)) + NUM_DENSE
        self.mlp = nn.Sequential(
            nn.Linear(n_in, 1024), nn.SiLU(), nn.Linear(1024, 512), nn.SiLU(),
            nn.Linear(512, 256), nn.SiLU(), nn.Linear(256, 1),
        ).to(device)

    def forward(self, id_kjt, tag_kjt, dense):
        x = torch.cat([self.id_ebc(id_kjt).values(), self.tag_ebc(tag_kjt).values(), dense], dim=1)
        return self.mlp(x).squeeze(1)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--batch_size", type=int, default=2048)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--emb_lr", type=float, default=0.02)
    ap.add_argument("--ckpt", default="/datasets/sv_logs/ckpt")
    ap.add_argument("--wandb_project", default="shortvideo-watch")
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()

    model = WatchModel(args.dim, device)
    apply_optimizer_in_backward(torch.optim.Adagrad,
                                list(model.id_ebc.parameters()) + list(model.tag_ebc.parameters()),
                                {"lr": args.emb_lr})
    planner = EmbeddingShardingPlanner(
        topology=Topology(world_size=world, local_world_size=get_local_size(), compute_device="cuda"),
        batch_size=args.batch_size,
    )
    plan = planner.collective_plan(model, get_default_sharders(), dist.GroupMember.WORLD)
    model = DistributedModelParallel(model, device=device, plan=plan)
    optimizer = CombinedOptimizer([
        model.fused_optimizer,
        KeyedOptimizerWrapper(dict(in_backward_optimizer_filter(model.named_parameters())),
                              lambda ps: torch.optim.AdamW(ps, lr=args.lr, weight_decay=1e-5)),
    ])

    train_ds, val_ds = WatchLogs(args.data, "train"), WatchLogs(args.data, "val")
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, shuffle=True, drop_last=True,
                              collate_fn=collate, num_workers=6, pin_memory=True, persistent_workers=True)
    val_loader = DataLoader(val_ds, batch_size=args.batch_size, shuffle=False, drop_last=True,
                            collate_fn=collate, num_workers=6, pin_memory=True)

    run = wandb.init(project=args.wandb_project, config=vars(args), name=os.environ.get("RUN_NAME")) \
        if rank == 0 else None

    step = 0
    for epoch in range(args.epochs):
        model.train()
        t0 = time.time()
        for id_kjt, tag_kjt, dense, labels in train_loader:
            logits = model(id_kjt.to(device), tag_kjt.to(device), dense.to(device))
            loss = F.binary_cross_entropy_with_logits(logits, labels.to(device))
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            step += 1
            if run is not None and step % 100 == 0:
                run.log({"train/loss": loss.item(),
                         "train/samples_per_s": 100 * args.batch_size * world / (time.time() - t0)}, step=step)
                t0 = time.time()

        model.eval()
        auroc = BinaryAUROC().to(device)
        with torch.no_grad():
            for id_kjt, tag_kjt, dense, labels in val_loader:
                logits = model(id_kjt.to(device), tag_kjt.to(device), dense.to(device))
                auroc.update(torch.sigmoid(logits), labels.to(device).long())
        auc = auroc.compute().item()
        if run is not None:
            run.log({"val/auc": auc, "epoch": epoch}, step=step)

        dcp.save({"model": model.state_dict(), "optim": optimizer.state_dict()},
                 checkpoint_id=os.path.join(args.ckpt, f"epoch_{epoch}"))

    if run is not None:
        run.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
