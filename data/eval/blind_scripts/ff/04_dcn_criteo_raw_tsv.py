"""DCN-v2 (TorchRec DLRM_DCN) on raw Criteo Kaggle/terabyte TSV days.

The raw TSV is parsed once into .npy arrays next to the data (the parse of a
single day takes ~20 minutes); later runs memory-map the cached arrays.

torchrun --nnodes 2 --nproc_per_node 8 --rdzv_backend c10d \
    --rdzv_endpoint $HEAD:29400 04_dcn_criteo_raw_tsv.py --raw_dir /fsx/criteo/raw
"""
import argparse
import os
import time

import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter
from torchmetrics.classification import BinaryAUROC
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor
from torchrec.datasets.criteo import DEFAULT_CAT_NAMES, DEFAULT_INT_NAMES, DEFAULT_LABEL_NAME
from torchrec.datasets.utils import Batch
from torchrec.distributed import TrainPipelineSparseDist
from torchrec.distributed.comm import get_local_size
from torchrec.distributed.model_parallel import DistributedModelParallel, get_default_sharders
from torchrec.distributed.planner import EmbeddingShardingPlanner, Topology
from torchrec.models.dlrm import DLRM_DCN, DLRMTrain
from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper
from torchrec.optim.optimizers import in_backward_optimizer_filter

COLUMNS = [DEFAULT_LABEL_NAME] + DEFAULT_INT_NAMES + DEFAULT_CAT_NAMES


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--raw_dir", required=True)
    p.add_argument("--train_days", type=str, default="0,1,2,3,4,5")
    p.add_argument("--val_day", type=int, default=6)
    p.add_argument("--max_ind_range", type=int, default=10_000_000)
    p.add_argument("--emb_dim", type=int, default=128)
    p.add_argument("--dcn_layers", type=int, default=3)
    p.add_argument("--dcn_rank", type=int, default=512)
    p.add_argument("--batch_size", type=int, default=2048)
    p.add_argument("--lr", type=float, default=0.005)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--ckpt_dir", default="/fsx/ckpt/dcn_criteo")
    p.add_argument("--tb_dir", default="/fsx/tb/dcn_criteo")
    return p.parse_args()


def parse_day(path, max_ind_range):
    df = pd.read_csv(path, sep="\t", header=None, names=COLUMNS, dtype=str, na_filter=False)
    labels = df[DEFAULT_LABEL_NAME].astype(np.int8).to_numpy()
    dense = (
        df[DEFAULT_INT_NAMES].replace("", "0").astype(np.float32).clip(lower=0).to_numpy()
    )
    sparse = np.empty((len(df), len(DEFAULT_CAT_NAMES)), dtype=np.int64)
    for j, c in enumerate(DEFAULT_CAT_NAMES):
        col = df[c].replace("", "0")
        sparse[:, j] = col.map(lambda h: int(h, 16) % max_ind_range).to_numpy()
    return np.log1p(dense), sparse, labels


def load_split(raw_dir, days, tag, max_ind_range):
    cache_dir = os.path.join(raw_dir, "npy_cache")
    os.makedirs(cache_dir, exist_ok=True)
    prefix = os.path.join(cache_dir, f"{tag}_m{max_ind_range}")
    if not os.path.exists(prefix + "_labels.npy"):
        parts = [parse_day(os.path.join(raw_dir, f"day_{d}"), max_ind_range) for d in days]
        np.save(prefix + "_dense.npy", np.concatenate([p[0] for p in parts]))
        np.save(prefix + "_sparse.npy", np.concatenate([p[1] for p in parts]))
        np.save(prefix + "_labels.npy", np.concatenate([p[2] for p in parts]))
    return (
        np.load(prefix + "_dense.npy", mmap_mode="r"),
        np.load(prefix + "_sparse.npy", mmap_mode="r"),
        np.load(prefix + "_labels.npy", mmap_mode="r"),
    )


class ArrayDataset(Dataset):
    def __init__(self, arrays):
        self.dense, self.sparse, self.labels = arrays

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, idx):
        return idx


class Collate:
    """Batches row indices so the memmaps are read with one fancy-index per batch."""

    def __init__(self, ds):
        self.ds = ds

    def __call__(self, idxs):
        idxs = np.sort(np.asarray(idxs))
        dense = torch.from_numpy(np.ascontiguousarray(self.ds.dense[idxs]))
        sparse = torch.from_numpy(np.ascontiguousarray(self.ds.sparse[idxs]))
        labels = torch.from_numpy(self.ds.labels[idxs].astype(np.float32))
        b, f = sparse.shape
        kjt = KeyedJaggedTensor.from_lengths_sync(
            keys=DEFAULT_CAT_NAMES,
            values=sparse.t().reshape(-1),
            lengths=torch.ones(b * f, dtype=torch.int32),
        )
        return Batch(dense_features=dense, sparse_features=kjt, labels=labels)


def build_model(args, device):
    ebc = EmbeddingBagCollection(
        tables=[
            EmbeddingBagConfig(
                name=f"t_{c}", embedding_dim=args.emb_dim,
                num_embeddings=args.max_ind_range, feature_names=[c],
            )
            for c in DEFAULT_CAT_NAMES
        ],
        device=torch.device("meta"),
    )
    net = DLRMTrain(
        DLRM_DCN(
            embedding_bag_collection=ebc,
            dense_in_features=len(DEFAULT_INT_NAMES),
            dense_arch_layer_sizes=[512, 256, args.emb_dim],
            over_arch_layer_sizes=[1024, 1024, 512, 256, 1],
            dcn_num_layers=args.dcn_layers,
            dcn_low_rank_dim=args.dcn_rank,
            dense_device=device,
        )
    )
    apply_optimizer_in_backward(torch.optim.Adagrad, net.model.sparse_arch.parameters(), {"lr": args.lr})
    planner = EmbeddingShardingPlanner(
        topology=Topology(
            local_world_size=get_local_size(), world_size=dist.get_world_size(), compute_device="cuda"
        ),
        batch_size=args.batch_size,
    )
    plan = planner.collective_plan(net, get_default_sharders(), dist.GroupMember.WORLD)
    model = DistributedModelParallel(module=net, device=device, plan=plan)
    dense_opt = KeyedOptimizerWrapper(
        dict(in_backward_optimizer_filter(model.named_parameters())),
        lambda params: torch.optim.Adagrad(params, lr=args.lr),
    )
    return model, CombinedOptimizer([model.fused_optimizer, dense_opt])


def evaluate(model, loader, device):
    model.eval()
    auroc = BinaryAUROC().to(device)
    with torch.no_grad():
        for batch in loader:
            batch = batch.to(device, non_blocking=True)
            _, (_, logits, labels) = model(batch)
            auroc.update(torch.sigmoid(logits), labels.long())
    model.train()
    return auroc.compute().item()


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device(f"cuda:{local_rank}")
    dist.init_process_group(backend="nccl")
    rank = dist.get_rank()

    train_days = [int(d) for d in args.train_days.split(",")]
    train_ds = ArrayDataset(load_split(args.raw_dir, train_days, "train", args.max_ind_range))
    val_ds = ArrayDataset(load_split(args.raw_dir, [args.val_day], "val", args.max_ind_range))

    train_sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    val_sampler = DistributedSampler(val_ds, shuffle=False, drop_last=True)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=train_sampler,
                              collate_fn=Collate(train_ds), num_workers=args.workers,
                              pin_memory=True, drop_last=True)
    val_loader = DataLoader(val_ds, batch_size=args.batch_size, sampler=val_sampler,
                            collate_fn=Collate(val_ds), num_workers=args.workers,
                            pin_memory=True, drop_last=True)

    model, optimizer = build_model(args, device)
    pipeline = TrainPipelineSparseDist(model, optimizer, device)
    tb = SummaryWriter(args.tb_dir) if rank == 0 else None

    step = 0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        it = iter(train_loader)
        t0 = time.time()
        while True:
            try:
                loss, _, _ = pipeline.progress(it)
            except StopIteration:
                break
            step += 1
            if tb is not None and step % 100 == 0:
                tb.add_scalar("train/loss", loss.item(), step)
                tb.add_scalar("train/it_per_s", 100 / (time.time() - t0), step)
                t0 = time.time()

        auc = evaluate(model, val_loader, device)
        if tb is not None:
            tb.add_scalar("val/auc", auc, step)
            print(f"epoch {epoch}: val auc {auc:.5f}", flush=True)
        dcp.save({"model": model.state_dict(), "optim": optimizer.state_dict()},
                 checkpoint_id=os.path.join(args.ckpt_dir, f"epoch_{epoch}"))

    if tb is not None:
        tb.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
