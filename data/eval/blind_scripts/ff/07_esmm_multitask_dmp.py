"""ESMM (CTR + CTCVR) multi-task ranking model on TorchRec.

Sparse features go through one EmbeddingBagCollection sharded by the planner;
the shared bottom and the two task towers are data parallel.

Launch: torchrun --nproc_per_node 8 07_esmm_multitask_dmp.py --train /data/esmm/train --val /data/esmm/val
"""
import argparse
import glob
import os
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
import torch.nn.functional as F
from sklearn.metrics import roc_auc_score
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor
from torchrec.distributed.comm import get_local_size
from torchrec.distributed.model_parallel import DistributedModelParallel, get_default_sharders
from torchrec.distributed.planner import EmbeddingShardingPlanner, Topology
from torchrec.optim import RowWiseAdagrad
from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper
from torchrec.optim.optimizers import in_backward_optimizer_filter

FEATURES = [
    ("user_id", 30_000_000),
    ("item_id", 8_000_000),
    ("shop_id", 900_000),
    ("brand_id", 400_000),
    ("cate_id", 12_000),
    ("user_gender", 4),
    ("user_age", 12),
    ("user_city", 5_000),
    ("pid", 64),
]
NUM_DENSE = 6


@dataclass
class EsmmBatch:
    dense: torch.Tensor
    sparse: KeyedJaggedTensor
    click: torch.Tensor
    conversion: torch.Tensor

    def to(self, device, non_blocking=False):
        return EsmmBatch(
            self.dense.to(device, non_blocking=non_blocking),
            self.sparse.to(device, non_blocking=non_blocking),
            self.click.to(device, non_blocking=non_blocking),
            self.conversion.to(device, non_blocking=non_blocking),
        )


class EsmmShards(Dataset):
    def __init__(self, root):
        shards = sorted(glob.glob(os.path.join(root, "*.npz")))
        parts = [np.load(s) for s in shards]
        self.sparse = np.concatenate([p["sparse"] for p in parts]).astype(np.int64)
        self.dense = np.concatenate([p["dense"] for p in parts]).astype(np.float32)
        self.click = np.concatenate([p["click"] for p in parts]).astype(np.float32)
        self.conv = np.concatenate([p["conversion"] for p in parts]).astype(np.float32)

    def __len__(self):
        return len(self.click)

    def __getitem__(self, i):
        return self.sparse[i], self.dense[i], self.click[i], self.conv[i]


def collate(rows):
    sparse = torch.from_numpy(np.stack([r[0] for r in rows]))
    b, f = sparse.shape
    return EsmmBatch(
        dense=torch.from_numpy(np.stack([r[1] for r in rows])),
        sparse=KeyedJaggedTensor.from_lengths_sync(
            keys=[n for n, _ in FEATURES],
            values=sparse.t().reshape(-1),
            lengths=torch.ones(b * f, dtype=torch.int32),
        ),
        click=torch.tensor([r[2] for r in rows]),
        conversion=torch.tensor([r[3] for r in rows]),
    )


def tower(in_dim, hidden):
    layers, d = [], in_dim
    for h in hidden:
        layers += [nn.Linear(d, h), nn.ReLU()]
        d = h
    layers.append(nn.Linear(d, 1))
    return nn.Sequential(*layers)


class ESMM(nn.Module):
    def __init__(self, dim, device):
        super().__init__()
        self.ebc = EmbeddingBagCollection(
            tables=[
                EmbeddingBagConfig(name=f"t_{n}", embedding_dim=dim, num_embeddings=rows, feature_names=[n])
                for n, rows in FEATURES
            ],
            device=torch.device("meta"),
        )
        in_dim = dim * len(FEATURES) + NUM_DENSE
        self.shared = nn.Sequential(nn.Linear(in_dim, 512), nn.ReLU()).to(device)
        self.ctr_tower = tower(512, [256, 128]).to(device)
        self.cvr_tower = tower(512, [256, 128]).to(device)

    def forward(self, dense, sparse):
        emb = self.ebc(sparse).values()
        h = self.shared(torch.cat([emb, dense], dim=1))
        return self.ctr_tower(h).squeeze(1), self.cvr_tower(h).squeeze(1)


def esmm_loss(ctr_logit, cvr_logit, click, conversion):
    p_ctr = torch.sigmoid(ctr_logit)
    p_ctcvr = p_ctr * torch.sigmoid(cvr_logit)
    loss_ctr = F.binary_cross_entropy_with_logits(ctr_logit, click)
    loss_ctcvr = F.binary_cross_entropy(p_ctcvr.clamp(1e-7, 1 - 1e-7), click * conversion)
    return loss_ctr + loss_ctcvr, p_ctr, p_ctcvr


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    ctr_p, ctcvr_p, clicks, buys = [], [], [], []
    for batch in loader:
        batch = batch.to(device, non_blocking=True)
        ctr_logit, cvr_logit = model(batch.dense, batch.sparse)
        _, p_ctr, p_ctcvr = esmm_loss(ctr_logit, cvr_logit, batch.click, batch.conversion)
        ctr_p.append(p_ctr.cpu())
        ctcvr_p.append(p_ctcvr.cpu())
        clicks.append(batch.click.cpu())
        buys.append((batch.click * batch.conversion).cpu())
    model.train()
    return {
        "ctr_auc": roc_auc_score(torch.cat(clicks).numpy(), torch.cat(ctr_p).numpy()),
        "ctcvr_auc": roc_auc_score(torch.cat(buys).numpy(), torch.cat(ctcvr_p).numpy()),
    }


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--train", required=True)
    ap.add_argument("--val", required=True)
    ap.add_argument("--ckpt", default="/nfs/ckpt/esmm")
    ap.add_argument("--dim", type=int, default=32)
    ap.add_argument("--batch_size", type=int, default=4096)
    ap.add_argument("--epochs", type=int, default=5)
    ap.add_argument("--eval_every", type=int, default=1)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--emb_lr", type=float, default=0.01)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    device = torch.device(f"cuda:{local_rank}")
    torch.cuda.set_device(device)
    dist.init_process_group("nccl")
    rank = dist.get_rank()

    model = ESMM(args.dim, device)
    apply_optimizer_in_backward(RowWiseAdagrad, model.ebc.parameters(), {"lr": args.emb_lr})
    planner = EmbeddingShardingPlanner(
        topology=Topology(world_size=dist.get_world_size(), local_world_size=get_local_size(),
                          compute_device="cuda"),
        batch_size=args.batch_size,
    )
    plan = planner.collective_plan(model, get_default_sharders(), dist.GroupMember.WORLD)
    model = DistributedModelParallel(model, device=device, plan=plan)
    dense_opt = KeyedOptimizerWrapper(
        dict(in_backward_optimizer_filter(model.named_parameters())),
        lambda ps: torch.optim.Adam(ps, lr=args.lr),
    )
    optimizer = CombinedOptimizer([model.fused_optimizer, dense_opt])

    train_ds = EsmmShards(args.train)
    sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=sampler, drop_last=True,
                              collate_fn=collate, num_workers=4, pin_memory=True)
    val_loader = None
    if rank == 0:
        val_loader = DataLoader(EsmmShards(args.val), batch_size=args.batch_size, shuffle=False,
                                collate_fn=collate, num_workers=4, pin_memory=True)

    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        for step, batch in enumerate(train_loader):
            batch = batch.to(device, non_blocking=True)
            ctr_logit, cvr_logit = model(batch.dense, batch.sparse)
            loss, _, _ = esmm_loss(ctr_logit, cvr_logit, batch.click, batch.conversion)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            if rank == 0 and step % 500 == 0:
                print(f"epoch {epoch} step {step} loss {loss.item():.5f}", flush=True)

        if rank == 0 and (epoch + 1) % args.eval_every == 0:
            m = evaluate(model, val_loader, device)
            print(f"epoch {epoch} ctr_auc {m['ctr_auc']:.5f} ctcvr_auc {m['ctcvr_auc']:.5f}", flush=True)
        dist.barrier()

        dcp.save({"model": model.state_dict(), "optim": optimizer.state_dict()},
                 checkpoint_id=os.path.join(args.ckpt, f"epoch{epoch}"))

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
