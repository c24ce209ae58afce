"""Streaming DLRM on hourly parquet partitions with TorchRec (row-wise big tables).

Every rank reads its own subset of the parquet files. Files have different
sizes, so the number of steps per epoch is agreed on up front from the parquet
footers (MIN over ranks) and every rank stops after exactly that many batches.

torchrun --nproc_per_node=8 18_rowwise_stream_equal_steps.py --train "/data/ctr/hour=*/part-*.parquet"
"""
import argparse
import glob
import itertools
import os
import time

import numpy as np
import pyarrow.parquet as pq
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import wandb
from torch.utils.data import DataLoader, IterableDataset, get_worker_info
from torchmetrics.classification import BinaryAUROC
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor
from torchrec.datasets.utils import Batch
from torchrec.distributed import TrainPipelineSparseDist
from torchrec.distributed.comm import get_local_size
from torchrec.distributed.model_parallel import DistributedModelParallel, get_default_sharders
from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints, Topology
from torchrec.distributed.types import ShardingType
from torchrec.models.dlrm import DLRM, DLRMTrain
from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper
from torchrec.optim.optimizers import in_backward_optimizer_filter

DENSE = [f"f{i}" for i in range(16)]
SPARSE = {"uid": 300_000_000, "iid": 50_000_000, "aid": 2_000_000, "pub": 800_000, "cat1": 3_000,
          "cat2": 40_000, "geo": 90_000, "dev": 512, "os": 64, "slot": 1_024}
ROW_WISE_MIN_ROWS = 10_000_000


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--train", required=True)
    ap.add_argument("--val", default="/data/ctr/val/part-*.parquet")
    ap.add_argument("--local-rank", "--local_rank", type=int, default=0,
                    help="accepted for torch.distributed.launch compatibility; LOCAL_RANK env wins")
    ap.add_argument("--batch_size", type=int, default=4096)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--lr", type=float, default=0.01)
    ap.add_argument("--epochs", type=int, default=1)
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--ckpt", default="/data/ckpt/stream_dlrm")
    ap.add_argument("--project", default="ctr-stream")
    return ap.parse_args()


def batches_in(files, batch_size):
    # the reader drops the partial batch at the end of every file
    return sum(pq.ParquetFile(f).metadata.num_rows // batch_size for f in files)


class ParquetStream(IterableDataset):
    def __init__(self, files, batch_size):
        super().__init__()
        self.files, self.batch_size = files, batch_size

    def __iter__(self):
        info = get_worker_info()
        files = self.files if info is None else self.files[info.id::info.num_workers]
        columns = ["label"] + DENSE + list(SPARSE)
        for path in files:
            table = pq.read_table(path, columns=columns)
            for start in range(0, table.num_rows - self.batch_size + 1, self.batch_size):
                yield self._batch(table.slice(start, self.batch_size))

    def _batch(self, t):
        b = t.num_rows
        dense = np.stack([t.column(c).to_numpy() for c in DENSE], axis=1).astype(np.float32)
        dense = torch.from_numpy(np.log1p(np.maximum(dense, 0)))
        values = torch.from_numpy(np.concatenate([t.column(k).to_numpy().astype(np.int64) for k in SPARSE]))
        kjt = KeyedJaggedTensor.from_lengths_sync(keys=list(SPARSE), values=values,
                                                  lengths=torch.ones(b * len(SPARSE), dtype=torch.int32))
        return Batch(dense_features=dense, sparse_features=kjt,
                     labels=torch.from_numpy(t.column("label").to_numpy().astype(np.float32)))


def agreed_steps(files, batch_size, device):
    n = torch.tensor([batches_in(files, batch_size)], device=device, dtype=torch.int64)
    dist.all_reduce(n, op=dist.ReduceOp.MIN)
    return int(n.item())


def build(args, device):
    tables = [EmbeddingBagConfig(name=f"t_{k}", embedding_dim=args.dim, num_embeddings=n, feature_names=[k])
              for k, n in SPARSE.items()]
    net = DLRMTrain(DLRM(
        embedding_bag_collection=EmbeddingBagCollection(tables=tables, device=torch.device("meta")),
        dense_in_features=len(DENSE),
        dense_arch_layer_sizes=[256, 128, args.dim],
        over_arch_layer_sizes=[512, 256, 128, 1],
        dense_device=device,
    ))
    apply_optimizer_in_backward(torch.optim.Adagrad, net.model.sparse_arch.parameters(), {"lr": args.lr})
    constraints = {t.name: ParameterConstraints(sharding_types=[ShardingType.ROW_WISE.value])
                   for t in tables if t.num_embeddings >= ROW_WISE_MIN_ROWS}
    planner = EmbeddingShardingPlanner(
        topology=Topology(world_size=dist.get_world_size(), local_world_size=get_local_size(),
                          compute_device="cuda"),
        batch_size=args.batch_size, constraints=constraints,
    )
    plan = planner.collective_plan(net, get_default_sharders(), dist.GroupMember.WORLD)
    model = DistributedModelParallel(net, device=device, plan=plan)
    dense_opt = KeyedOptimizerWrapper(dict(in_backward_optimizer_filter(model.named_parameters())),
                                      lambda ps: torch.optim.Adagrad(ps, lr=args.lr))
    return model, CombinedOptimizer([model.fused_optimizer, dense_opt])


def main():
    args = parse_args()
    local_rank = int(os.environ.get("LOCAL_RANK", args.local_rank))
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()

    all_train, all_val = sorted(glob.glob(args.train)), sorted(glob.glob(args.val))
    my_train, my_val = all_train[rank::world], all_val[rank::world]
    train_steps = agreed_steps(my_train, args.batch_size, device)
    val_steps = agreed_steps(my_val, args.batch_size, device)

    def loader(files):
        return DataLoader(ParquetStream(files, args.batch_size), batch_size=None,
                          num_workers=args.workers, pin_memory=True)

    model, optimizer = build(args, device)
    pipeline = TrainPipelineSparseDist(model, optimizer, device, execute_all_batches=True)
    run = wandb.init(project=args.project, config=vars(args) | {"world_size": world}) if rank == 0 else None
    if run is not None:
        run.summary["train_steps_per_epoch"] = train_steps

    global_step = 0
    for epoch in range(args.epochs):
        model.train()
        it = itertools.islice(iter(loader(my_train)), train_steps)
        t0 = time.time()
        while True:
            try:
                loss, _, _ = pipeline.progress(it)
            except StopIteration:
                break
            global_step += 1
            if run is not None and global_step % 100 == 0:
                run.log({"loss": loss.item(), "qps": 100 * args.batch_size * world / (time.time() - t0)},
                        step=global_step)
                t0 = time.time()

        model.eval()
        auroc = BinaryAUROC().to(device)
        it = itertools.islice(iter(loader(my_val)), val_steps)
        with torch.no_grad():
            while True:
                try:
                    _, logits, labels = pipeline.progress(it)
                except StopIteration:
                    break
                auroc.update(torch.sigmoid(logits), labels.long())
        auc = auroc.compute().item()
        if run is not None:
            run.log({"val_auc": auc, "epoch": epoch}, step=global_step)

        dcp.save({"model": model.state_dict(), "optim": optimizer.state_dict()},
                 checkpoint_id=os.path.join(args.ckpt, f"epoch_{epoch}"))

    if run is not None:
        run.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
