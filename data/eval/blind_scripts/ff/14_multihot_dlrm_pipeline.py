"""Multi-hot DLRM with TorchRec's sparse-dist training pipeline.

Each sample carries a variable number of ids per feature (multi-hot); they are
stored CSR-style per feature (values + offsets) in one .npz per split.
The TrainPipelineSparseDist overlaps the input all-to-all of the next batch
with the compute of the current one.

torchrun --nproc_per_node=8 14_multihot_dlrm_pipeline.py --data /datasets/mh_criteo
"""
import argparse
import logging
import os

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torchmetrics.classification import BinaryAUROC
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor
from torchrec.datasets.utils import Batch
from torchrec.distributed import TrainPipelineSparseDist
from torchrec.distributed.comm import get_local_size
from torchrec.distributed.model_parallel import DistributedModelParallel, get_default_sharders
from torchrec.distributed.planner import EmbeddingShardingPlanner, Topology
from torchrec.distributed.planner.storage_reservations import HeuristicalStorageReservation
from torchrec.models.dlrm import DLRM, DLRMTrain
from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper
from torchrec.optim.optimizers import in_backward_optimizer_filter
from torchrec.optim.warmup import WarmupOptimizer, WarmupPolicy, WarmupStage

log = logging.getLogger("mh_dlrm")
NUM_DENSE = 13
CAT = [f"cat_{i}" for i in range(26)]
TABLE_ROWS = [
    40_000_000, 39_060, 17_295, 7_424, 20_265, 3, 7_122, 1_543, 63, 40_000_000, 3_067_956, 405_282, 10,
    2_209, 11_938, 155, 4, 976, 14, 40_000_000, 40_000_000, 40_000_000, 590_152, 12_973, 108, 36,
]


class MultiHotSplit(Dataset):
    def __init__(self, path):
        z = np.load(path)
        self.dense = z["dense"]
        self.labels = z["labels"]
        self.values = [z[f"{c}_values"] for c in CAT]
        self.offsets = [z[f"{c}_offsets"] for c in CAT]

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, i):
        ids = [v[o[i]:o[i + 1]] for v, o in zip(self.values, self.offsets)]
        return self.dense[i], ids, self.labels[i]


def collate(rows):
    dense = torch.from_numpy(np.log1p(np.maximum(np.stack([r[0] for r in rows]), 0)).astype(np.float32))
    labels = torch.from_numpy(np.array([r[2] for r in rows], dtype=np.float32))
    values, lengths = [], []
    for f in range(len(CAT)):
        for r in rows:
            values.append(r[1][f])
            lengths.append(len(r[1][f]))
    kjt = KeyedJaggedTensor.from_lengths_sync(
        keys=CAT,
        values=torch.from_numpy(np.concatenate(values).astype(np.int64)),
        lengths=torch.tensor(lengths, dtype=torch.int32),
    )
    return Batch(dense_features=dense, sparse_features=kjt, labels=labels)


def build(args, device, steps_per_epoch):
    ebc = EmbeddingBagCollection(
        tables=[EmbeddingBagConfig(name=f"t_{c}", embedding_dim=args.dim, num_embeddings=n, feature_names=[c])
                for c, n in zip(CAT, TABLE_ROWS)],
        device=torch.device("meta"),
    )
    net = DLRMTrain(DLRM(
        embedding_bag_collection=ebc,
        dense_in_features=NUM_DENSE,
        dense_arch_layer_sizes=[512, 256, args.dim],
        over_arch_layer_sizes=[1024, 1024, 512, 256, 1],
        dense_device=device,
    ))
    apply_optimizer_in_backward(torch.optim.Adagrad, net.model.sparse_arch.parameters(),
                                {"lr": args.lr, "eps": 1e-8})
    planner = EmbeddingShardingPlanner(
        topology=Topology(local_world_size=get_local_size(), world_size=dist.get_world_size(),
                          compute_device="cuda"),
        batch_size=args.batch_size,
        storage_reservation=HeuristicalStorageReservation(percentage=0.05),
    )
    plan = planner.collective_plan(net, get_default_sharders(), dist.GroupMember.WORLD)
    model = DistributedModelParallel(net, device=device, plan=plan)
    dense_opt = KeyedOptimizerWrapper(
        dict(in_backward_optimizer_filter(model.named_parameters())),
        lambda ps: torch.optim.Adagrad(ps, lr=args.lr, eps=1e-8),
    )
    total = steps_per_epoch * args.epochs
    optimizer = WarmupOptimizer(
        CombinedOptimizer([model.fused_optimizer, dense_opt]),
        stages=[
            WarmupStage(policy=WarmupPolicy.LINEAR, max_iters=args.warmup_steps, value=0.1, lr_scale=1.0),
            WarmupStage(policy=WarmupPolicy.POLY, max_iters=total, value=1.0, lr_scale=1.0, decay_iters=total),
        ],
        lr=args.lr,
    )
    return model, optimizer


def evaluate(pipeline, model, loader, device):
    model.eval()
    auroc = BinaryAUROC().to(device)
    it = iter(loader)
    with torch.no_grad():
        while True:
            try:
                _, logits, labels = pipeline.progress(it)
            except StopIteration:
                break
            auroc.update(torch.sigmoid(logits), labels.long())
    model.train()
    return auroc.compute().item()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--batch_size", type=int, default=8192)
    ap.add_argument("--epochs", type=int, default=4)
    ap.add_argument("--lr", type=float, default=0.004)
    ap.add_argument("--warmup_steps", type=int, default=1000)
    ap.add_argument("--ckpt_dir", default="/shared/ckpt/mh_dlrm")
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    device = torch.device("cuda", local_rank)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARN,
                        format="%(asctime)s %(levelname)s %(message)s")

    train_ds = MultiHotSplit(os.path.join(args.data, "train.npz"))
    val_ds = MultiHotSplit(os.path.join(args.data, "val.npz"))
    train_sampler = DistributedSampler(train_ds, shuffle=True, seed=1234, drop_last=True)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=train_sampler, drop_last=True,
                              collate_fn=collate, num_workers=8, pin_memory=True, persistent_workers=True)
    val_loader = DataLoader(val_ds, batch_size=args.batch_size, drop_last=True, collate_fn=collate,
                            sampler=DistributedSampler(val_ds, shuffle=False, drop_last=True),
                            num_workers=8, pin_memory=True)

    model, optimizer = build(args, device, len(train_loader))
    pipeline = TrainPipelineSparseDist(model, optimizer, device, execute_all_batches=True)

    for epoch in range(args.epochs):
        model.train()
        it = iter(train_loader)
        step = 0
        while True:
            try:
                loss, _, _ = pipeline.progress(it)
            except StopIteration:
                break
            step += 1
            if step % 250 == 0:
                log.info("epoch %d step %d/%d loss %.5f", epoch, step, len(train_loader), loss.item())

        auc = evaluate(pipeline, model, val_loader, device)
        log.info("epoch %d val auc %.5f", epoch, auc)
        dcp.save({"model": model.state_dict(), "optim": optimizer.state_dict()},
                 checkpoint_id=os.path.join(args.ckpt_dir, f"epoch_{epoch}"))
        if rank == 0:
            with open(os.path.join(args.ckpt_dir, "latest"), "w") as f:
                f.write(f"epoch_{epoch}\n")

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
