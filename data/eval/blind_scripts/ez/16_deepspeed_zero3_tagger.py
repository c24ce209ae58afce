#!/usr/bin/env python
"""Doc encoder + 1M free tag vectors (DEXA-lite), ZeRO-3 so the tag table and its
Adam states are sharded over the GPUs.

Evaluation gathers the full tag table once per epoch (GatheredParameters) and
every rank scores its slice of the test products against all tags.

    deepspeed --num_gpus 8 16_deepspeed_zero3_tagger.py \
        --data-dir /mnt/shared/tagging/catalog_1m_tok --encoder /mnt/shared/models/e5-base-v2
"""
import argparse
import math
import os

import deepspeed
import numpy as np
import scipy.sparse as sp
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoModel


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data-dir", required=True)
    ap.add_argument("--encoder", required=True)
    ap.add_argument("--out", default="/mnt/shared/tagging/runs/dexa_lite")
    ap.add_argument("--dim", type=int, default=768)
    ap.add_argument("--micro-batch", type=int, default=128)
    ap.add_argument("--grad-accum", type=int, default=1)
    ap.add_argument("--num-neg", type=int, default=16384)
    ap.add_argument("--max-pos", type=int, default=8)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--epochs", type=int, default=5)
    ap.add_argument("--tau", type=float, default=0.05)
    ap.add_argument("--local_rank", type=int, default=-1)   # the deepspeed launcher passes this
    return ap.parse_args()


class Docs(Dataset):
    def __init__(self, ids, Y, max_pos, total=None):
        self.ids, self.Y, self.max_pos = ids, Y, max_pos
        self.total = ids.shape[0] if total is None else total

    def __len__(self):
        return self.total

    def __getitem__(self, i):
        real = i < self.ids.shape[0]
        r = i if real else self.ids.shape[0] - 1
        labs = self.Y.indices[self.Y.indptr[r]:self.Y.indptr[r + 1]][: self.max_pos]
        pos = np.full(self.max_pos, -1, dtype=np.int64)
        pos[: len(labs)] = labs
        return torch.from_numpy(self.ids[r].astype(np.int64)), torch.from_numpy(pos), real


class DexaLite(nn.Module):
    def __init__(self, encoder, num_labels, dim):
        super().__init__()
        self.encoder = AutoModel.from_pretrained(encoder, add_pooling_layer=False)
        self.label_w = nn.Embedding(num_labels, dim)
        nn.init.normal_(self.label_w.weight, std=0.02)

    def embed(self, ids):
        mask = (ids != 0).long()
        h = self.encoder(input_ids=ids, attention_mask=mask).last_hidden_state
        return F.normalize((h * mask.unsqueeze(-1)).sum(1) / mask.sum(1, keepdim=True), dim=-1)

    def forward(self, ids, cand=None):
        q = self.embed(ids)
        if cand is None:
            return q
        return q @ F.normalize(self.label_w(cand), dim=-1).t()


@torch.no_grad()
def evaluate(engine, loader, device, k=5):
    engine.eval()
    # ZeRO-3 keeps only a shard of label_w on each rank; gather the full table for scoring
    with deepspeed.zero.GatheredParameters(engine.module.label_w.weight, modifier_rank=None):
        W = F.normalize(engine.module.label_w.weight.detach().float(), dim=-1).to(torch.bfloat16)
    acc = torch.zeros(3, dtype=torch.float64, device=device)
    for ids, pos, real in loader:
        ids, pos, real = ids.to(device), pos.to(device), real.to(device).double()
        q = engine(ids).to(torch.bfloat16)              # same number of calls on every rank
        top = (q @ W.t()).topk(k, dim=1).indices
        hit = (top.unsqueeze(-1) == pos.unsqueeze(1)).any(-1).double()
        acc[0] += (hit[:, 0] * real).sum()
        acc[1] += (hit.mean(1) * real).sum()
        acc[2] += real.sum()
    dist.all_reduce(acc)
    del W
    engine.train()
    return (acc[0] / acc[2]).item(), (acc[1] / acc[2]).item()


def main():
    args = get_args()
    local_rank = int(os.environ.get("LOCAL_RANK", args.local_rank))
    torch.cuda.set_device(local_rank)
    deepspeed.init_distributed(dist_backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(123)

    ids_tr = np.load(os.path.join(args.data_dir, "train_ids.npy"), mmap_mode="r")
    ids_te = np.load(os.path.join(args.data_dir, "test_ids.npy"), mmap_mode="r")
    Y_tr = sp.load_npz(os.path.join(args.data_dir, "Y_train.npz")).tocsr()
    Y_te = sp.load_npz(os.path.join(args.data_dir, "Y_test.npz")).tocsr()
    num_labels = Y_tr.shape[1]

    train_ds = Docs(ids_tr, Y_tr, args.max_pos)
    padded = math.ceil(ids_te.shape[0] / world) * world
    test_ds = Subset(Docs(ids_te, Y_te, args.max_pos, total=padded), range(rank, padded, world))
    sampler = DistributedSampler(train_ds, shuffle=True, seed=123, drop_last=True)
    train_loader = DataLoader(train_ds, batch_size=args.micro_batch, sampler=sampler,
                              num_workers=4, pin_memory=True, drop_last=True)
    test_loader = DataLoader(test_ds, batch_size=256, num_workers=2)

    updates = args.epochs * len(train_loader) // args.grad_accum
    ds_config = {
        "train_batch_size": args.micro_batch * args.grad_accum * world,
        "train_micro_batch_size_per_gpu": args.micro_batch,
        "gradient_accumulation_steps": args.grad_accum,
        "gradient_clipping": 1.0,
        "bf16": {"enabled": True},
        "optimizer": {"type": "AdamW", "params": {"lr": args.lr, "weight_decay": 0.01}},
        "scheduler": {"type": "WarmupCosineLR",
                      "params": {"total_num_steps": updates, "warmup_num_steps": 1000}},
        "zero_optimization": {
            "stage": 3,
            "overlap_comm": True,
            "stage3_param_persistence_threshold": 1e5,
            "stage3_gather_16bit_weights_on_model_save": True,
        },
        "wall_clock_breakdown": False,
    }
    model = DexaLite(args.encoder, num_labels, args.dim)
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                           config=ds_config)

    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        for step, (ids, pos, _) in enumerate(train_loader):
            ids, pos = ids.to(device), pos.to(device)
            valid = pos >= 0
            neg = torch.randint(0, num_labels, (args.num_neg,), device=device)
            cand = torch.unique(torch.cat([pos[valid], neg]))
            logits = engine(ids, cand).float() / args.tau
            target = torch.zeros_like(logits)
            target.scatter_add_(1, torch.searchsorted(cand, pos.clamp(min=0)), valid.float())
            target = target.clamp(max=1.0)
            target = target / target.sum(1, keepdim=True).clamp(min=1.0)
            loss = -(target * logits.log_softmax(-1)).sum(1).mean()
            engine.backward(loss)
            engine.step()
            if rank == 0 and step % 500 == 0:
                print(f"epoch {epoch} step {step} loss {loss.item():.4f} lr {engine.get_lr()[0]:.2e}",
                      flush=True)

        p1, p5 = evaluate(engine, test_loader, device)
        if rank == 0:
            print(f"epoch {epoch} P@1 {p1:.4f} P@5 {p5:.4f}", flush=True)
        # both calls are collective under ZeRO-3: every rank has to enter them
        engine.save_checkpoint(args.out, tag=f"epoch{epoch}", client_state={"p1": p1, "p5": p5})
        engine.save_16bit_model(os.path.join(args.out, f"export_epoch{epoch}"), "model.bin")

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
