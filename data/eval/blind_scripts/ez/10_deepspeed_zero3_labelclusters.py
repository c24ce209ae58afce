#!/usr/bin/env python
"""BERT encoder + 3M-tag embedding table, trained with DeepSpeed ZeRO-3.

Negatives: uniform + "cluster" negatives drawn from the k-means cluster of each
positive tag. The tag clusters are re-computed from the learned tag embeddings
after every epoch.

    deepspeed --num_gpus 8 10_deepspeed_zero3_labelclusters.py \
        --data-dir /mnt/shared/xmc/amazon3m_tok --encoder /mnt/shared/models/bert-base-uncased
"""
import argparse
import json
import math
import os

import deepspeed
import faiss
import numpy as np
import scipy.sparse as sp
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoModel


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data-dir", required=True)
    ap.add_argument("--encoder", required=True)
    ap.add_argument("--output-dir", default="/mnt/shared/xmc/runs/zero3_clusters")
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--micro-batch", type=int, default=64)
    ap.add_argument("--grad-accum", type=int, default=2)
    ap.add_argument("--lr", type=float, default=5e-5)
    ap.add_argument("--epochs", type=int, default=6)
    ap.add_argument("--num-clusters", type=int, default=16384)
    ap.add_argument("--uniform-neg", type=int, default=8192)
    ap.add_argument("--max-pos", type=int, default=16)
    ap.add_argument("--seed", type=int, default=17)
    ap.add_argument("--local_rank", type=int, default=-1)   # passed by the deepspeed launcher
    return ap.parse_args()


class TokenDocs(Dataset):
    def __init__(self, ids, Y, max_pos, n_rows=None):
        self.ids, self.Y, self.max_pos = ids, Y, max_pos
        self.n = ids.shape[0] if n_rows is None else n_rows

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        valid = i < self.ids.shape[0]
        r = i if valid else 0
        labs = self.Y.indices[self.Y.indptr[r]:self.Y.indptr[r + 1]][: self.max_pos]
        pos = np.full(self.max_pos, -1, dtype=np.int64)
        pos[: len(labs)] = labs
        return torch.from_numpy(self.ids[r].astype(np.int64)), torch.from_numpy(pos), valid


class Tagger(nn.Module):
    def __init__(self, encoder_path, num_labels, dim):
        super().__init__()
        self.bert = AutoModel.from_pretrained(encoder_path, add_pooling_layer=False)
        self.proj = nn.Linear(self.bert.config.hidden_size, dim)
        self.label_emb = nn.Embedding(num_labels, dim)
        self.num_labels = num_labels
        nn.init.normal_(self.label_emb.weight, std=0.02)

    def forward(self, ids, cand=None):
        mask = (ids != 0).long()
        h = self.proj(self.bert(input_ids=ids, attention_mask=mask).last_hidden_state[:, 0])
        if cand is None:
            cand = torch.arange(self.num_labels, device=ids.device)
        return h @ self.label_emb(cand).t()


def sample_cluster_negatives(pos, members, offsets, sizes, label_cluster):
    c = label_cluster[pos]
    pick = (torch.rand(pos.shape, device=pos.device) * sizes[c]).long()
    return members[offsets[c] + pick]


def recluster_labels(engine, num_labels, num_clusters, device, seed):
    assign = torch.empty(num_labels, dtype=torch.long, device=device)
    if dist.get_rank() == 0:
        W = engine.module.label_emb.weight.detach().float().cpu().numpy()
        faiss.normalize_L2(W)
        km = faiss.Kmeans(W.shape[1], num_clusters, niter=15, seed=seed, spherical=True,
                          max_points_per_centroid=256)
        km.train(W)
        _, a = km.index.search(W, 1)
        assign.copy_(torch.from_numpy(a.ravel().astype(np.int64)))
    dist.broadcast(assign, src=0)
    return assign


def cluster_tables(assign, num_clusters):
    order = torch.argsort(assign)
    sizes = torch.bincount(assign, minlength=num_clusters)
    offsets = torch.cumsum(sizes, 0) - sizes
    return order, offsets, sizes.clamp(min=1).float()


@torch.no_grad()
def evaluate(engine, loader, device, k=5):
    engine.eval()
    acc = torch.zeros(3, dtype=torch.float64, device=device)
    for ids, pos, valid in loader:
        ids, pos, valid = ids.to(device), pos.to(device), valid.to(device).double()
        top = engine(ids).float().topk(k, dim=1).indices
        hit = (top.unsqueeze(-1) == pos.unsqueeze(1)).any(-1).double()
        acc[0] += (hit[:, 0] * valid).sum()
        acc[1] += (hit.sum(1) / k * valid).sum()
        acc[2] += valid.sum()
    dist.all_reduce(acc)
    engine.train()
    return (acc[0] / acc[2]).item(), (acc[1] / acc[2]).item()


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    deepspeed.init_distributed(dist_backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(args.seed)

    d = args.data_dir
    tr_ids = np.load(os.path.join(d, "train_ids.npy"), mmap_mode="r")
    te_ids = np.load(os.path.join(d, "test_ids.npy"), mmap_mode="r")
    Y_tr = sp.load_npz(os.path.join(d, "Y_train.npz")).tocsr()
    Y_te = sp.load_npz(os.path.join(d, "Y_test.npz")).tocsr()
    num_labels = Y_tr.shape[1]

    train_ds = TokenDocs(tr_ids, Y_tr, args.max_pos)
    # pad the test set to a multiple of world size so every rank runs the same number of
    # forward passes (ZeRO-3 gathers parameters inside forward); padded rows are masked out
    test_ds = TokenDocs(te_ids, Y_te, args.max_pos, n_rows=math.ceil(te_ids.shape[0] / world) * world)
    test_ds = torch.utils.data.Subset(test_ds, range(rank, len(test_ds), world))
    sampler = DistributedSampler(train_ds, shuffle=True, seed=args.seed, drop_last=True)
    train_loader = DataLoader(train_ds, batch_size=args.micro_batch, sampler=sampler,
                              num_workers=4, pin_memory=True, drop_last=True)
    test_loader = DataLoader(test_ds, batch_size=64, num_workers=2)

    steps = args.epochs * len(train_loader) // args.grad_accum
    ds_config = {
        "train_micro_batch_size_per_gpu": args.micro_batch,
        "gradient_accumulation_steps": args.grad_accum,
        "gradient_clipping": 1.0,
        "bf16": {"enabled": True},
        "optimizer": {"type": "AdamW", "params": {"lr": args.lr, "betas": [0.9, 0.999],
                                                  "eps": 1e-8, "weight_decay": 0.01}},
        "scheduler": {"type": "WarmupDecayLR", "params": {
            "warmup_min_lr": 0.0, "warmup_max_lr": args.lr,
            "warmup_num_steps": int(0.05 * steps), "total_num_steps": steps}},
        "zero_optimization": {"stage": 3, "overlap_comm": True, "contiguous_gradients": True,
                              "stage3_gather_16bit_weights_on_model_save": True},
        "steps_per_print": 500,
    }
    model = Tagger(args.encoder, num_labels, args.dim)
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                           config=ds_config)

    members = offsets = sizes = label_cluster = None
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        for step, (ids, pos, _) in enumerate(train_loader):
            ids, pos = ids.to(device), pos.to(device)
            valid = pos >= 0
            pos_flat = pos[valid]
            negs = [torch.randint(0, num_labels, (args.uniform_neg,), device=device)]
            if label_cluster is not None:
                negs.append(sample_cluster_negatives(pos_flat, members, offsets, sizes, label_cluster))
            cand = torch.unique(torch.cat([pos_flat] + negs))
            logits = engine(ids, cand).float()
            target = torch.zeros_like(logits)
            target.scatter_add_(1, torch.searchsorted(cand, pos.clamp(min=0)), valid.float())
            loss = F.binary_cross_entropy_with_logits(logits, target.clamp(max=1.0), reduction="sum")
            loss = loss / ids.size(0)
            engine.backward(loss)
            engine.step()
            if rank == 0 and step % 500 == 0:
                print(f"epoch {epoch} step {step} loss {loss.item():.4f}", flush=True)

        p1, p5 = evaluate(engine, test_loader, device)
        if rank == 0:
            print(f"epoch {epoch} P@1 {p1:.4f} P@5 {p5:.4f}", flush=True)
        engine.save_checkpoint(args.output_dir, tag=f"epoch{epoch}",
                               client_state={"epoch": epoch, "p1": p1, "p5": p5})

        label_cluster = recluster_labels(engine, num_labels, args.num_clusters, device, args.seed + epoch)
        members, offsets, sizes = cluster_tables(label_cluster, args.num_clusters)
        if rank == 0:
            with open(os.path.join(args.output_dir, f"clusters_epoch{epoch}.json"), "w") as f:
                json.dump({"num_clusters": args.num_clusters,
                           "sizes": torch.bincount(label_cluster).tolist()[:100]}, f)

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
