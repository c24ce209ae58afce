"""Streaming CTR training on daily parquet impression logs.

TorchRec DistributedModelParallel; the planner decides table-wise / row-wise
sharding for the id tables, dense arch is data parallel.

Each parquet file: label (int8), d0..d12 (float32), the single-valued sparse
columns in SINGLE_FEATURES (int64, already hashed to the table size) and a list
column `hist_item_ids` (last 50 clicked items).
"""
import argparse
import glob
import logging
import os
import time

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torchmetrics
from fbgemm_gpu.split_embedding_configs import EmbOptimType
from torch.utils.data import DataLoader, IterableDataset, get_worker_info
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor
from torchrec.datasets.utils import Batch
from torchrec.distributed.comm import get_local_size
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.planner import EmbeddingShardingPlanner, Topology
from torchrec.models.dlrm import DLRM, DLRMTrain
from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper
from torchrec.optim.optimizers import in_backward_optimizer_filter

log = logging.getLogger(__name__)

NUM_DENSE = 13
DENSE_COLS = [f"d{i}" for i in range(NUM_DENSE)]
SINGLE_FEATURES = {
    "user_id": 50_000_000,
    "item_id": 20_000_000,
    "advertiser_id": 400_000,
    "campaign_id": 2_000_000,
    "category_id": 5_000,
    "device_type": 16,
    "os_version": 512,
    "geo_city": 60_000,
    "hour_of_week": 168,
    "slot_id": 2_048,
}
LIST_FEATURES = {"hist_item_ids": "item_id"}  # list column -> table it shares
SPARSE_KEYS = list(SINGLE_FEATURES) + list(LIST_FEATURES)


class ParquetImpressions(IterableDataset):
    def __init__(self, files, batch_size, rank, world_size):
        super().__init__()
        self.files = sorted(files)
        self.batch_size = batch_size
        self.rank = rank
        self.world_size = world_size

    def _to_batch(self, table):
        b = table.num_rows
        dense = np.stack([table.column(c).to_numpy() for c in DENSE_COLS], axis=1)
        dense = torch.from_numpy(np.log1p(np.maximum(dense, 0.0)).astype(np.float32))
        labels = torch.from_numpy(table.column("label").to_numpy().astype(np.float32))
        values, lengths = [], []
        for name in SINGLE_FEATURES:
            values.append(torch.from_numpy(table.column(name).to_numpy().astype(np.int64)))
            lengths.append(torch.ones(b, dtype=torch.int32))
        for name in LIST_FEATURES:
            arr = table.column(name).combine_chunks()
            offsets = arr.offsets.to_numpy()
            values.append(torch.from_numpy(arr.values.to_numpy().astype(np.int64)))
            lengths.append(torch.from_numpy(np.diff(offsets).astype(np.int32)))
        kjt = KeyedJaggedTensor.from_lengths_sync(
            keys=SPARSE_KEYS, values=torch.cat(values), lengths=torch.cat(lengths)
        )
        return Batch(dense_features=dense, sparse_features=kjt, labels=labels)

    def __iter__(self):
        files = self.files[self.rank :: self.world_size]
        info = get_worker_info()
        if info is not None:
            files = files[info.id :: info.num_workers]
        for path in files:
            pf = pq.ParquetFile(path)
            for rb in pf.iter_batches(batch_size=self.batch_size):
                if rb.num_rows < self.batch_size:
                    continue
                yield self._to_batch(pa.Table.from_batches([rb]))


def build(args, device):
    tables = []
    for name, size in SINGLE_FEATURES.items():
        feats = [name] + [lf for lf, t in LIST_FEATURES.items() if t == name]
        tables.append(
            EmbeddingBagConfig(
                name=f"t_{name}", embedding_dim=args.emb_dim, num_embeddings=size, feature_names=feats
            )
        )
    dlrm = DLRM(
        embedding_bag_collection=EmbeddingBagCollection(tables=tables, device=torch.device("meta")),
        dense_in_features=NUM_DENSE,
        dense_arch_layer_sizes=[256, 128, args.emb_dim],
        over_arch_layer_sizes=[512, 256, 1],
        dense_device=device,
    )
    sharder = EmbeddingBagCollectionSharder(
        fused_params={
            "optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD,
            "learning_rate": args.sparse_lr,
            "eps": 1e-8,
        }
    )
    train_model = DLRMTrain(dlrm)
    planner = EmbeddingShardingPlanner(
        topology=Topology(
            world_size=dist.get_world_size(),
            local_world_size=get_local_size(),
            compute_device="cuda",
        ),
        batch_size=args.batch_size,
    )
    plan = planner.collective_plan(train_model, [sharder], dist.GroupMember.WORLD)
    model = DistributedModelParallel(train_model, device=device, plan=plan, sharders=[sharder])
    dense_opt = KeyedOptimizerWrapper(
        dict(in_backward_optimizer_filter(model.named_parameters())),
        lambda ps: torch.optim.Adam(ps, lr=args.dense_lr),
    )
    return model, CombinedOptimizer([model.fused_optimizer, dense_opt])


def make_loader(files, args):
    ds = ParquetImpressions(files, args.batch_size, dist.get_rank(), dist.get_world_size())
    return DataLoader(
        ds, batch_size=None, num_workers=args.num_workers, pin_memory=True, prefetch_factor=4
    )


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    auroc = torchmetrics.AUROC(task="binary").to(device)
    loss_sum = torch.zeros((), device=device)
    n = torch.zeros((), device=device)
    for batch in loader:
        batch = batch.to(device, non_blocking=True)
        loss, (_, logits, labels) = model(batch)
        auroc.update(torch.sigmoid(logits), labels.int())
        loss_sum += loss * labels.numel()
        n += labels.numel()
    dist.all_reduce(loss_sum)
    dist.all_reduce(n)
    model.train()
    return (loss_sum / n).item(), auroc.compute().item()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--train_glob", default="/data/impressions/dt=2024-0[1-3]-*/part-*.parquet")
    ap.add_argument("--val_glob", default="/data/impressions/dt=2024-04-01/part-*.parquet")
    ap.add_argument("--ckpt_dir", default="/mnt/fsx/ckpt/ads_ctr")
    ap.add_argument("--batch_size", type=int, default=4096)
    ap.add_argument("--emb_dim", type=int, default=64)
    ap.add_argument("--dense_lr", type=float, default=1e-3)
    ap.add_argument("--sparse_lr", type=float, default=0.02)
    ap.add_argument("--epochs", type=int, default=1)
    ap.add_argument("--num_workers", type=int, default=4)
    ap.add_argument("--log_every", type=int, default=200)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    device = torch.device("cuda", local_rank)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    logging.basicConfig(
        level=logging.INFO if rank == 0 else logging.ERROR,
        format=f"[rank{rank}] %(asctime)s %(message)s",
    )

    train_files = glob.glob(args.train_glob)
    val_files = glob.glob(args.val_glob)
    log.info("%d train files, %d val files", len(train_files), len(val_files))

    model, optimizer = build(args, device)
    train_loader = make_loader(train_files, args)
    val_loader = make_loader(val_files, args)

    step = 0
    for epoch in range(args.epochs):
        t0 = time.time()
        for batch in train_loader:
            batch = batch.to(device, non_blocking=True)
            loss, _ = model(batch)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            step += 1
            if step % args.log_every == 0:
                qps = args.log_every * args.batch_size * dist.get_world_size() / (time.time() - t0)
                log.info("epoch %d step %d loss %.4f qps %.0f", epoch, step, loss.item(), qps)
                t0 = time.time()

        val_loss, val_auc = evaluate(model, val_loader, device)
        log.info("epoch %d val loss %.5f auc %.5f", epoch, val_loss, val_auc)
        dcp.save(
            {"model": model.state_dict(), "optim": optimizer.state_dict()},
            checkpoint_id=os.path.join(args.ckpt_dir, f"epoch{epoch}"),
        )

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
