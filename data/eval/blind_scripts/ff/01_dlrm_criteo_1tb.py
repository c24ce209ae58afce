#!/usr/bin/env python3
"""DLRM on the preprocessed Criteo 1TB click logs with TorchRec.

Embedding tables are sharded by the TorchRec planner, the dense/over arch is
data parallel. Expects the output of torchrec's criteo preprocessing
(day_*_dense.npy / day_*_sparse_multi_hot.npz / day_*_labels.npy).
"""
import argparse
import logging
import os
import time
from typing import List

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from sklearn.metrics import roc_auc_score
from torch.utils.data import DataLoader
from torchrec import EmbeddingBagCollection
from torchrec.datasets.criteo import (
    DAYS,
    DEFAULT_CAT_NAMES,
    DEFAULT_INT_NAMES,
    InMemoryBinaryCriteoIterDataPipe,
)
from torchrec.distributed import TrainPipelineSparseDist
from torchrec.distributed.comm import get_local_size
from torchrec.distributed.model_parallel import (
    DistributedModelParallel,
    get_default_sharders,
)
from torchrec.distributed.planner import EmbeddingShardingPlanner, Topology
from torchrec.distributed.planner.storage_reservations import (
    HeuristicalStorageReservation,
)
from torchrec.models.dlrm import DLRM, DLRMTrain
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper
from torchrec.optim.optimizers import in_backward_optimizer_filter

logger = logging.getLogger("dlrm")

ADAGRAD_EPS = 1e-8


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data_dir", required=True)
    p.add_argument("--ckpt_dir", default="/mnt/shared/ckpt/dlrm_criteo")
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--batch_size", type=int, default=8192, help="per rank")
    p.add_argument("--val_batch_size", type=int, default=16384)
    p.add_argument("--embedding_dim", type=int, default=128)
    p.add_argument(
        "--num_embeddings_per_feature",
        type=str,
        default="40000000,39060,17295,7424,20265,3,7122,1543,63,40000000,"
        "3067956,405282,10,2209,11938,155,4,976,14,40000000,40000000,"
        "40000000,590152,12973,108,36",
    )
    p.add_argument("--dense_arch_layer_sizes", type=str, default="512,256,128")
    p.add_argument("--over_arch_layer_sizes", type=str, default="1024,1024,512,256,1")
    p.add_argument("--lr", type=float, default=0.005)
    p.add_argument("--validate_every", type=int, default=5000)
    p.add_argument("--limit_val_batches", type=int, default=0)
    p.add_argument("--pin_memory", action="store_true")
    p.add_argument("--mmap_mode", action="store_true")
    return p.parse_args()


def _csv_ints(s: str) -> List[int]:
    return [int(x) for x in s.split(",") if x]


def get_dataloader(args, stage: str, hashes: List[int]) -> DataLoader:
    files = os.listdir(args.data_dir)

    def is_final_day(name: str) -> bool:
        return f"day_{DAYS - 1}" in name

    if stage == "train":
        files = [f for f in files if not is_final_day(f)]
        rank, world_size = dist.get_rank(), dist.get_world_size()
    else:
        # final day split in half: first half val, second half test
        files = [f for f in files if is_final_day(f)]
        rank = dist.get_rank() if stage == "val" else dist.get_rank() + dist.get_world_size()
        world_size = dist.get_world_size() * 2

    stage_files = [
        sorted(os.path.join(args.data_dir, f) for f in files if kind in f)
        for kind in ("dense", "sparse", "labels")
    ]
    batch_size = args.batch_size if stage == "train" else args.val_batch_size
    pipe = InMemoryBinaryCriteoIterDataPipe(
        stage,
        *stage_files,
        batch_size=batch_size,
        rank=rank,
        world_size=world_size,
        drop_last=True,
        shuffle_batches=stage == "train",
        mmap_mode=args.mmap_mode,
        hashes=hashes,
    )
    return DataLoader(pipe, batch_size=None, pin_memory=args.pin_memory, collate_fn=lambda x: x)


def build_model(args, device, hashes):
    tables = [
        EmbeddingBagConfig(
            name=f"t_{name}",
            embedding_dim=args.embedding_dim,
            num_embeddings=hashes[i],
            feature_names=[name],
        )
        for i, name in enumerate(DEFAULT_CAT_NAMES)
    ]
    dlrm = DLRM(
        embedding_bag_collection=EmbeddingBagCollection(tables=tables, device=torch.device("meta")),
        dense_in_features=len(DEFAULT_INT_NAMES),
        dense_arch_layer_sizes=_csv_ints(args.dense_arch_layer_sizes),
        over_arch_layer_sizes=_csv_ints(args.over_arch_layer_sizes),
        dense_device=device,
    )
    train_model = DLRMTrain(dlrm)

    apply_optimizer_in_backward(
        torch.optim.Adagrad,
        train_model.model.sparse_arch.parameters(),
        {"lr": args.lr, "eps": ADAGRAD_EPS},
    )

    planner = EmbeddingShardingPlanner(
        topology=Topology(
            local_world_size=get_local_size(),
            world_size=dist.get_world_size(),
            compute_device=device.type,
        ),
        batch_size=args.batch_size,
        storage_reservation=HeuristicalStorageReservation(percentage=0.05),
    )
    plan = planner.collective_plan(train_model, get_default_sharders(), dist.GroupMember.WORLD)
    model = DistributedModelParallel(module=train_model, device=device, plan=plan)
    if dist.get_rank() == 0:
        logger.info("sharding plan:\n%s", plan)

    dense_opt = KeyedOptimizerWrapper(
        dict(in_backward_optimizer_filter(model.named_parameters())),
        lambda params: torch.optim.Adagrad(params, lr=args.lr, eps=ADAGRAD_EPS),
    )
    optimizer = CombinedOptimizer([model.fused_optimizer, dense_opt])
    return model, optimizer


def evaluate(args, model, loader, device):
    model.eval()
    preds, targets, losses = [], [], []
    with torch.no_grad():
        for n, batch in enumerate(loader):
            if args.limit_val_batches and n >= args.limit_val_batches:
                break
            batch = batch.to(device, non_blocking=True)
            _, (loss, logits, labels) = model(batch)
            preds.append(torch.sigmoid(logits).float().cpu())
            targets.append(labels.float().cpu())
            losses.append(loss.item())
    model.train()
    preds = torch.cat(preds).numpy()
    targets = torch.cat(targets).numpy()
    auc = roc_auc_score(targets, preds)
    return float(np.mean(losses)), float(auc)


def save_checkpoint(model, optimizer, path, step):
    state = {"model": model.state_dict(), "optim": optimizer.state_dict()}
    dcp.save(state, checkpoint_id=os.path.join(path, f"step_{step}"))
    if dist.get_rank() == 0:
        with open(os.path.join(path, "latest"), "w") as f:
            f.write(f"step_{step}\n")


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    device = torch.device(f"cuda:{local_rank}")
    torch.cuda.set_device(device)
    dist.init_process_group(backend="nccl")
    rank = dist.get_rank()

    logging.basicConfig(
        level=logging.INFO if rank == 0 else logging.WARNING,
        format="%(asctime)s [%(levelname)s] %(message)s",
    )
    os.makedirs(args.ckpt_dir, exist_ok=True)

    hashes = _csv_ints(args.num_embeddings_per_feature)
    assert len(hashes) == len(DEFAULT_CAT_NAMES)
    model, optimizer = build_model(args, device, hashes)

    train_loader = get_dataloader(args, "train", hashes)
    val_loader = get_dataloader(args, "val", hashes)

    pipeline = TrainPipelineSparseDist(model, optimizer, device)
    best_auc = 0.0
    step = 0
    for epoch in range(args.epochs):
        model.train()
        it = iter(train_loader)
        t0 = time.time()
        while True:
            try:
                loss, _, _ = pipeline.progress(it)
            except StopIteration:
                break
            step += 1
            if rank == 0 and step % 100 == 0:
                dt = time.time() - t0
                qps = 100 * args.batch_size * dist.get_world_size() / dt
                logger.info("epoch %d step %d loss %.5f qps %.0f", epoch, step, loss.item(), qps)
                t0 = time.time()

            if step % args.validate_every == 0:
                val_loss, val_auc = evaluate(args, model, val_loader, device)
                best_auc = max(best_auc, val_auc)
                if rank == 0:
                    logger.info(
                        "step %d val_loss %.5f val_auc %.5f best %.5f", step, val_loss, val_auc, best_auc
                    )
                save_checkpoint(model, optimizer, args.ckpt_dir, step)

    val_loss, val_auc = evaluate(args, model, val_loader, device)
    if rank == 0:
        logger.info("final val_loss %.5f val_auc %.5f (best %.5f)", val_loss, val_auc, best_auc)
    save_checkpoint(model, optimizer, args.ckpt_dir, step)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
