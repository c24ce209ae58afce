"""DLRM-style CTR model on preprocessed Criteo (day-split .npz files), DeepSpeed ZeRO-2.

    deepspeed --num_nodes 1 --num_gpus 8 02_dlrm_criteo.py --data-dir /data/criteo_kaggle_npz
"""
import argparse
import logging
import os
import time

import deepspeed
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
from sklearn.metrics import roc_auc_score
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

log = logging.getLogger(__name__)

NUM_DENSE = 13
NUM_SPARSE = 26


class CriteoNpz(Dataset):
    def __init__(self, path, hash_size):
        blob = np.load(path)
        self.dense = np.log1p(np.maximum(blob["X_int"], 0)).astype(np.float32)
        self.sparse = (blob["X_cat"] % hash_size).astype(np.int64)
        self.labels = blob["y"].astype(np.float32)

    def __len__(self):
        return self.labels.shape[0]

    def __getitem__(self, idx):
        return self.dense[idx], self.sparse[idx], self.labels[idx]


def mlp(sizes, last_act=True):
    layers = []
    for i in range(len(sizes) - 1):
        layers.append(nn.Linear(sizes[i], sizes[i + 1]))
        if i < len(sizes) - 2 or last_act:
            layers.append(nn.ReLU(inplace=True))
    return nn.Sequential(*layers)


class DLRM(nn.Module):
    def __init__(self, hash_size, emb_dim=64, bottom=(512, 256), top=(1024, 512, 256)):
        super().__init__()
        self.embeddings = nn.ModuleList(
            [nn.Embedding(hash_size, emb_dim) for _ in range(NUM_SPARSE)]
        )
        self.bottom = mlp([NUM_DENSE, *bottom, emb_dim])
        n_feat = NUM_SPARSE + 1
        n_inter = n_feat * (n_feat - 1) // 2
        self.top = mlp([emb_dim + n_inter, *top, 1], last_act=False)
        iu = torch.triu_indices(n_feat, n_feat, offset=1)
        self.register_buffer("iu0", iu[0], persistent=False)
        self.register_buffer("iu1", iu[1], persistent=False)
        for emb in self.embeddings:
            nn.init.uniform_(emb.weight, -0.01, 0.01)

    def forward(self, dense, sparse):
        x = self.bottom(dense)
        embs = [x] + [emb(sparse[:, i]) for i, emb in enumerate(self.embeddings)]
        feats = torch.stack(embs, dim=1)  # B x F x D
        inter = torch.bmm(feats, feats.transpose(1, 2))
        inter = inter[:, self.iu0, self.iu1]
        return self.top(torch.cat([x, inter], dim=1)).squeeze(1)


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data-dir", required=True)
    ap.add_argument("--hash-size", type=int, default=1_000_000)
    ap.add_argument("--emb-dim", type=int, default=64)
    ap.add_argument("--batch-size", type=int, default=2048, help="per GPU")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--num-workers", type=int, default=4)
    ap.add_argument("--save-dir", default="checkpoints/dlrm")
    ap.add_argument("--local_rank", type=int, default=-1)
    return ap.parse_args()


def ds_config(args):
    return {
        "train_micro_batch_size_per_gpu": args.batch_size,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "Adam", "params": {"lr": args.lr, "betas": [0.9, 0.999], "eps": 1e-8}},
        "fp16": {"enabled": True, "loss_scale": 0, "initial_scale_power": 14},
        "zero_optimization": {
            "stage": 2,
            "offload_optimizer": {"device": "cpu", "pin_memory": True},
            "overlap_comm": True,
            "contiguous_gradients": True,
        },
        "steps_per_print": 500,
    }


@torch.no_grad()
def evaluate(engine, loader):
    engine.eval()
    preds, labels = [], []
    for dense, sparse, y in loader:
        dense = dense.to(engine.device).half()
        sparse = sparse.to(engine.device)
        logits = engine(dense, sparse)
        preds.append(torch.sigmoid(logits.float()))
        labels.append(y.to(engine.device))
    preds = torch.cat(preds)
    labels = torch.cat(labels)
    world = dist.get_world_size()
    all_preds = [torch.empty_like(preds) for _ in range(world)]
    all_labels = [torch.empty_like(labels) for _ in range(world)]
    dist.all_gather(all_preds, preds)
    dist.all_gather(all_labels, labels)
    engine.train()
    if dist.get_rank() != 0:
        return None
    p = torch.cat(all_preds).cpu().numpy()
    t = torch.cat(all_labels).cpu().numpy()
    logloss = -np.mean(t * np.log(p + 1e-7) + (1 - t) * np.log(1 - p + 1e-7))
    return roc_auc_score(t, p), logloss


def main():
    args = get_args()
    logging.basicConfig(level=logging.INFO, format="[%(asctime)s] %(message)s")
    deepspeed.init_distributed()
    rank = dist.get_rank()

    train_set = CriteoNpz(os.path.join(args.data_dir, "train.npz"), args.hash_size)
    val_set = CriteoNpz(os.path.join(args.data_dir, "val.npz"), args.hash_size)

    train_loader = DataLoader(train_set, batch_size=args.batch_size, shuffle=True,
                              num_workers=args.num_workers, pin_memory=True, drop_last=True)
    val_loader = DataLoader(val_set, batch_size=8192,
                            sampler=DistributedSampler(val_set, shuffle=False),
                            num_workers=args.num_workers, pin_memory=True)

    model = DLRM(args.hash_size, emb_dim=args.emb_dim)
    engine, optimizer, _, _ = deepspeed.initialize(
        model=model, model_parameters=model.parameters(), config=ds_config(args)
    )
    criterion = nn.BCEWithLogitsLoss()

    if rank == 0:
        n_params = sum(p.numel() for p in model.parameters())
        log.info("DLRM params: %.1fM, train rows %d", n_params / 1e6, len(train_set))
        os.makedirs(args.save_dir, exist_ok=True)

    best_auc = 0.0
    for epoch in range(args.epochs):
        engine.train()
        tic = time.time()
        for it, (dense, sparse, y) in enumerate(train_loader):
            dense = dense.to(engine.device, non_blocking=True).half()
            sparse = sparse.to(engine.device, non_blocking=True)
            y = y.to(engine.device, non_blocking=True)

            logits = engine(dense, sparse)
            loss = criterion(logits.float(), y)
            engine.backward(loss)
            engine.step()

            if rank == 0 and it % 1000 == 0:
                ex_s = (it + 1) * args.batch_size * dist.get_world_size() / (time.time() - tic)
                log.info("ep %d it %d loss %.5f  %.0f ex/s", epoch, it, loss.item(), ex_s)

        result = evaluate(engine, val_loader)
        if rank == 0:
            auc, ll = result
            log.info("epoch %d: val AUC %.5f logloss %.5f", epoch, auc, ll)
            best_auc = max(best_auc, auc)

        engine.save_checkpoint(args.save_dir, tag=f"ep{epoch}", client_state={"epoch": epoch})

    if rank == 0:
        torch.save({k: v.float().cpu() for k, v in engine.module.state_dict().items()},
                   os.path.join(args.save_dir, "dlrm_final.pt"))
        log.info("best AUC %.5f", best_auc)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
