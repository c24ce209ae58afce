"""DLRM on TorchRec reporting normalized entropy (NE) and calibration.

The four 40M-row tables are table-row-wise sharded (rows split inside a node,
which keeps their all-to-all on NVLink); everything else is left to the planner.

    torchrun --nnodes 2 --nproc_per_node 8 --rdzv_backend c10d --rdzv_endpoint $HOST0:29500 \
        16_dlrm_twrw_criteo.py --data /mnt/lustre/criteo_npy
"""
import argparse
import math
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor
from torchrec.datasets.criteo import DEFAULT_CAT_NAMES, DEFAULT_INT_NAMES
from torchrec.datasets.utils import Batch
from torchrec.distributed.comm import get_local_size
from torchrec.distributed.model_parallel import DistributedModelParallel, get_default_sharders
from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints, Topology
from torchrec.distributed.types import ShardingType
from torchrec.models.dlrm import DLRM, DLRMTrain
from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper
from torchrec.optim.optimizers import in_backward_optimizer_filter

ROWS = [40000000, 39060, 17295, 7424, 20265, 3, 7122, 1543, 63, 40000000, 3067956, 405282, 10, 2209,
        11938, 155, 4, 976, 14, 40000000, 40000000, 40000000, 590152, 12973, 108, 36]


class CriteoDay(Dataset):
    def __init__(self, root, days):
        self.parts = []
        for d in days:
            self.parts.append((
                np.load(os.path.join(root, f"day_{d}_dense.npy"), mmap_mode="r"),
                np.load(os.path.join(root, f"day_{d}_sparse.npy"), mmap_mode="r"),
                np.load(os.path.join(root, f"day_{d}_labels.npy"), mmap_mode="r"),
            ))
        self.offsets = np.cumsum([0] + [len(p[2]) for p in self.parts])

    def __len__(self):
        return int(self.offsets[-1])

    def __getitem__(self, i):
        k = int(np.searchsorted(self.offsets, i, side="right") - 1)
        j = i - self.offsets[k]
        dense, sparse, labels = self.parts[k]
        return np.asarray(dense[j], dtype=np.float32), np.asarray(sparse[j], dtype=np.int64), float(labels[j])


def collate(rows):
    dense = torch.from_numpy(np.log1p(np.maximum(np.stack([r[0] for r in rows]), 0)))
    sparse = torch.from_numpy(np.stack([r[1] for r in rows]))
    b, f = sparse.shape
    kjt = KeyedJaggedTensor.from_lengths_sync(keys=DEFAULT_CAT_NAMES, values=sparse.t().reshape(-1),
                                              lengths=torch.ones(b * f, dtype=torch.int32))
    return Batch(dense_features=dense, sparse_features=kjt,
                 labels=torch.tensor([r[2] for r in rows], dtype=torch.float32))


def build(args, device):
    tables = [EmbeddingBagConfig(name=f"t_{c}", embedding_dim=args.dim, num_embeddings=n, feature_names=[c])
              for c, n in zip(DEFAULT_CAT_NAMES, ROWS)]
    net = DLRMTrain(DLRM(
        embedding_bag_collection=EmbeddingBagCollection(tables=tables, device=torch.device("meta")),
        dense_in_features=len(DEFAULT_INT_NAMES),
        dense_arch_layer_sizes=[512, 256, args.dim],
        over_arch_layer_sizes=[1024, 1024, 512, 256, 1],
        dense_device=device,
    ))
    apply_optimizer_in_backward(torch.optim.Adagrad, net.model.sparse_arch.parameters(), {"lr": args.lr})
    constraints = {
        t.name: ParameterConstraints(sharding_types=[ShardingType.TABLE_ROW_WISE.value])
        for t in tables if t.num_embeddings >= 10_000_000
    }
    planner = EmbeddingShardingPlanner(
        topology=Topology(local_world_size=get_local_size(), world_size=dist.get_world_size(),
                          compute_device="cuda"),
        batch_size=args.batch_size,
        constraints=constraints,
    )
    plan = planner.collective_plan(net, get_default_sharders(), dist.GroupMember.WORLD)
    model = DistributedModelParallel(net, device=device, plan=plan)
    dense_opt = KeyedOptimizerWrapper(dict(in_backward_optimizer_filter(model.named_parameters())),
                                      lambda ps: torch.optim.Adagrad(ps, lr=args.lr))
    return model, CombinedOptimizer([model.fused_optimizer, dense_opt])


def ne_and_calibration(logloss_sum, n, pos, pred_sum):
    ctr = pos / n
    baseline = -(ctr * math.log(ctr) + (1 - ctr) * math.log(1 - ctr))
    return (logloss_sum / n) / baseline, pred_sum / pos


def evaluate(model, loader, device):
    model.eval()
    logloss_sum, n, pos, pred_sum = 0.0, 0, 0.0, 0.0
    with torch.no_grad():
        for batch in loader:
            batch = batch.to(device, non_blocking=True)
            _, (_, logits, labels) = model(batch)
            logloss_sum += torch.nn.functional.binary_cross_entropy_with_logits(
                logits, labels, reduction="sum").item()
            n += labels.numel()
            pos += labels.sum().item()
            pred_sum += torch.sigmoid(logits).sum().item()
    stats = torch.tensor([logloss_sum, n, pos, pred_sum], dtype=torch.float64)
    dist.all_reduce(stats)
    model.train()
    return ne_and_calibration(*stats.tolist())


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--train_days", default="0-22")
    ap.add_argument("--val_day", type=int, default=23)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--batch_size", type=int, default=4096)
    ap.add_argument("--lr", type=float, default=0.01)
    ap.add_argument("--eval_every", type=int, default=20000)
    ap.add_argument("--ckpt", default="/mnt/lustre/ckpt/dlrm_ne")
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    dist.init_process_group(backend="nccl")
    rank = dist.get_rank()

    lo, hi = (int(x) for x in args.train_days.split("-"))
    train_ds = CriteoDay(args.data, range(lo, hi + 1))
    val_ds = CriteoDay(args.data, [args.val_day])
    sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=sampler, collate_fn=collate,
                        drop_last=True, num_workers=8, pin_memory=True, persistent_workers=True)
    val_loader = DataLoader(val_ds, batch_size=args.batch_size, collate_fn=collate, drop_last=True,
                            sampler=DistributedSampler(val_ds, shuffle=False, drop_last=True),
                            num_workers=8, pin_memory=True)

    model, optimizer = build(args, device)
    sampler.set_epoch(0)
    t0 = time.time()
    for step, batch in enumerate(loader, start=1):
        batch = batch.to(device, non_blocking=True)
        loss, _ = model(batch)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if rank == 0 and step % 500 == 0:
            print(f"step {step}/{len(loader)} loss {loss.item():.5f} "
                  f"{500 / (time.time() - t0):.1f} it/s", flush=True)
            t0 = time.time()
        if step % args.eval_every == 0 or step == len(loader):
            ne, calib = evaluate(model, val_loader, device)
            if rank == 0:
                print(f"step {step} val NE {ne:.5f} calibration {calib:.4f}", flush=True)
            dcp.save({"model": model.state_dict(), "optim": optimizer.state_dict()},
                     checkpoint_id=os.path.join(args.ckpt, f"step_{step}"))

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
