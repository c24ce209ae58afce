"""DeepFM click-through-rate model on Criteo-style parquet shards, DeepSpeed ZeRO-3.

Validation AUC / log-loss every --eval-interval steps (scikit-learn on the full
gathered validation set). The best step is tagged "best" in the DeepSpeed
checkpoint directory and also exported as consolidated fp16 weights; early stop
on AUC; the best engine state is reloaded for the test split.

    deepspeed --num_gpus 8 14_ctr_deepfm_deepspeed.py --data /shared/criteo_parquet
"""
import argparse
import os

import deepspeed
import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
import torch.nn as nn
from sklearn.metrics import log_loss, roc_auc_score
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

DENSE = [f"I{i}" for i in range(1, 14)]
SPARSE = [f"C{i}" for i in range(1, 27)]


class CTRFrame(Dataset):
    def __init__(self, path, hash_size):
        df = pd.read_parquet(path)
        self.dense = torch.tensor(np.log1p(df[DENSE].clip(lower=0).fillna(0).values), dtype=torch.float32)
        # hashed ids are deterministic (no per-process vocab)
        self.sparse = torch.tensor(
            np.stack([pd.util.hash_array(df[c].fillna("").astype(str).values) % hash_size for c in SPARSE], 1)
            .astype(np.int64))
        self.label = torch.tensor(df["label"].values, dtype=torch.float32)

    def __len__(self):
        return len(self.label)

    def __getitem__(self, i):
        return i, self.dense[i], self.sparse[i], self.label[i]


class DeepFM(nn.Module):
    def __init__(self, hash_size, dim=16, hidden=(400, 400, 400)):
        super().__init__()
        self.emb = nn.Embedding(len(SPARSE) * hash_size, dim)
        self.lin = nn.Embedding(len(SPARSE) * hash_size, 1)
        self.register_buffer("offsets", torch.arange(len(SPARSE)) * hash_size, persistent=False)
        self.dense_proj = nn.Linear(len(DENSE), dim)
        layers, d = [], dim * (len(SPARSE) + 1)
        for h in hidden:
            layers += [nn.Linear(d, h), nn.ReLU(), nn.Dropout(0.2)]
            d = h
        self.mlp = nn.Sequential(*layers, nn.Linear(d, 1))

    def forward(self, dense, sparse):
        ids = sparse + self.offsets
        dense = dense.to(self.dense_proj.weight.dtype)
        e = torch.cat([self.emb(ids), self.dense_proj(dense).unsqueeze(1)], 1)  # (B, F, D)
        fm = 0.5 * (e.sum(1).pow(2) - e.pow(2).sum(1)).sum(1)
        return self.lin(ids).sum((1, 2)) + fm + self.mlp(e.flatten(1)).squeeze(1)


@torch.no_grad()
def predict_all(engine, loader, n_total):
    """Same number of batches on every rank (ZeRO-3 forwards gather parameters collectively)."""
    engine.eval()
    idx, probs, labels = [], [], []
    for i, dense, sparse, y in loader:
        logit = engine(dense.to(engine.device), sparse.to(engine.device))
        idx.append(i.to(engine.device))
        probs.append(torch.sigmoid(logit.float()))
        labels.append(y.to(engine.device))
    engine.train()
    # float64 keeps the sample indices exact; same shape on every rank
    local = torch.stack([torch.cat(idx).double(), torch.cat(probs).double(), torch.cat(labels).double()])
    gathered = [torch.empty_like(local) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, local)
    allv = torch.cat(gathered, 1).cpu().numpy()
    _, first = np.unique(allv[0].astype(np.int64), return_index=True)  # drop the sampler's padding repeats
    assert len(first) == n_total
    return allv[1, first], allv[2, first]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--data", required=True)
    parser.add_argument("--ckpt-dir", default="/shared/ckpt/deepfm")
    parser.add_argument("--hash-size", type=int, default=200_000)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--eval-interval", type=int, default=2000)
    parser.add_argument("--patience", type=int, default=4)
    parser.add_argument("--micro-batch", type=int, default=2048)
    parser.add_argument("--lr", type=float, default=1e-3, help="tuned for 8 GPUs x 2048")
    parser.add_argument("--local_rank", type=int, default=-1)
    args = parser.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    deepspeed.init_distributed(dist_backend="nccl")
    rank = dist.get_rank()

    ds_cfg = {
        "train_micro_batch_size_per_gpu": args.micro_batch,
        "gradient_accumulation_steps": 1,
        "bf16": {"enabled": True},
        "optimizer": {"type": "Adam", "params": {"lr": args.lr, "betas": [0.9, 0.999], "eps": 1e-8}},
        "zero_optimization": {
            "stage": 3,
            "stage3_gather_16bit_weights_on_model_save": True,
            "stage3_param_persistence_threshold": 1e5,
        },
        "steps_per_print": 1000,
    }
    micro_bs = args.micro_batch

    train_ds = CTRFrame(os.path.join(args.data, "train.parquet"), args.hash_size)
    val_ds = CTRFrame(os.path.join(args.data, "val.parquet"), args.hash_size)
    test_ds = CTRFrame(os.path.join(args.data, "test.parquet"), args.hash_size)
    train_sampler = DistributedSampler(train_ds, shuffle=True, seed=0)
    train_loader = DataLoader(train_ds, batch_size=micro_bs, sampler=train_sampler, num_workers=4,
                              drop_last=True, pin_memory=True)
    val_loader = DataLoader(val_ds, batch_size=8192, sampler=DistributedSampler(val_ds, shuffle=False))
    test_loader = DataLoader(test_ds, batch_size=8192, sampler=DistributedSampler(test_ds, shuffle=False))

    model = DeepFM(args.hash_size)
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_cfg)
    bce = nn.BCEWithLogitsLoss()

    best_auc, evals_since_best, done = 0.0, 0, False
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        for _, dense, sparse, y in train_loader:
            logit = engine(dense.to(engine.device), sparse.to(engine.device))
            loss = bce(logit.float(), y.to(engine.device))
            engine.backward(loss)
            engine.step()
            if not engine.is_gradient_accumulation_boundary():
                continue
            step = engine.global_steps
            if step % args.eval_interval:
                continue

            p, t = predict_all(engine, val_loader, len(val_ds))
            auc, ll = roc_auc_score(t, p), log_loss(t, p)  # identical on every rank
            if rank == 0:
                print(f"[val] epoch {epoch} step {step} AUC {auc:.5f} logloss {ll:.5f}", flush=True)
            if auc > best_auc:
                best_auc, evals_since_best = auc, 0
                # both calls are collective: every rank writes its own ZeRO shard / joins the gather
                engine.save_checkpoint(args.ckpt_dir, tag="best", client_state={"step": step, "auc": auc})
                engine.save_16bit_model(os.path.join(args.ckpt_dir, "best_fp16"), "deepfm.bin")
            else:
                evals_since_best += 1
                done = evals_since_best >= args.patience
            if done:
                break
        if done:
            break

    load_path, client = engine.load_checkpoint(args.ckpt_dir, tag="best", load_optimizer_states=False,
                                               load_lr_scheduler_states=False)
    p, t = predict_all(engine, test_loader, len(test_ds))
    if rank == 0:
        print(f"[test] best step {client['step']} (val AUC {client['auc']:.5f}): "
              f"test AUC {roc_auc_score(t, p):.5f} logloss {log_loss(t, p):.5f}", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
