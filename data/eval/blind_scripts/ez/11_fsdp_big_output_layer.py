#!/usr/bin/env python
"""Small transformer over product titles + 5M-row tag embedding table, sharded with FSDP.

Training uses sampled softmax: the other products' positives in the batch plus
log-uniform (Zipfian) negatives over the frequency-sorted tag ids, with the
logQ correction and accidental-hit masking.

    torchrun --nnodes=2 --nproc_per_node=8 --rdzv_backend=c10d --rdzv_endpoint=$HEAD:29500 \
        11_fsdp_big_output_layer.py --data-dir /fsx/tagging/catalog_5m --out /fsx/tagging/runs/fsdp5m
"""
import argparse
import functools
import math
import os
import time

import numpy as np
import scipy.sparse as sp
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.fsdp import FullOptimStateDictConfig, FullStateDictConfig, MixedPrecision
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp import ShardingStrategy, StateDictType
from torch.distributed.fsdp.wrap import ModuleWrapPolicy
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data-dir", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--vocab", type=int, default=250_000)
    p.add_argument("--d-model", type=int, default=512)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--num-sampled", type=int, default=32768)
    p.add_argument("--max-pos", type=int, default=16)
    p.add_argument("--global-batch-size", type=int, default=4096)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--epochs", type=int, default=8)
    p.add_argument("--warmup-steps", type=int, default=2000)
    return p.parse_args()


class Titles(Dataset):
    def __init__(self, ids, Y, max_pos, n_rows=None):
        self.ids, self.Y, self.max_pos = ids, Y, max_pos
        self.n = ids.shape[0] if n_rows is None else n_rows

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        real = i < self.ids.shape[0]
        r = i if real else 0
        labs = self.Y.indices[self.Y.indptr[r]:self.Y.indptr[r + 1]]
        pos = np.full(self.max_pos, -1, dtype=np.int64)
        pos[: min(len(labs), self.max_pos)] = labs[: self.max_pos]
        first = int(np.random.choice(labs)) if len(labs) else 0
        return torch.from_numpy(self.ids[r].astype(np.int64)), torch.from_numpy(pos), first, real


class TitleEncoder(nn.Module):
    def __init__(self, vocab, d, layers, num_labels, max_len=64):
        super().__init__()
        self.tok = nn.Embedding(vocab, d, padding_idx=0)
        self.pos = nn.Parameter(torch.zeros(1, max_len, d))
        layer = nn.TransformerEncoderLayer(d, 8, 4 * d, dropout=0.1, batch_first=True, norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(d)
        self.label_emb = nn.Embedding(num_labels, d)
        nn.init.normal_(self.label_emb.weight, std=0.02)
        self.num_labels = num_labels

    def forward(self, ids, cand=None):
        pad = ids == 0
        x = self.encoder(self.tok(ids) + self.pos[:, : ids.size(1)], src_key_padding_mask=pad)
        x = self.norm((x * (~pad).unsqueeze(-1)).sum(1) / (~pad).sum(1, keepdim=True).clamp(min=1))
        if cand is None:
            cand = torch.arange(self.num_labels, device=ids.device)
        return x @ self.label_emb(cand).t()


def log_uniform_sample(n, num_labels, device):
    """Zipfian sample over ids sorted by descending frequency (as in TF's sampled_softmax)."""
    s = torch.exp(torch.rand(n, device=device) * math.log(num_labels + 1)).long() - 1
    return s.clamp_(0, num_labels - 1)


def log_q(ids, num_labels):
    ids = ids.double()
    return torch.log(torch.log((ids + 2) / (ids + 1)) / math.log(num_labels + 1)).float()


@torch.no_grad()
def evaluate(model, loader, device, k=5):
    model.eval()
    acc = torch.zeros(3, dtype=torch.float64, device=device)
    for ids, pos, _, real in loader:
        ids, pos, real = ids.to(device), pos.to(device), real.to(device).double()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            top = model(ids).float().topk(k, dim=1).indices
        hit = (top.unsqueeze(-1) == pos.unsqueeze(1)).any(-1).double()
        acc[0] += (hit[:, 0] * real).sum()
        acc[1] += (hit.mean(1) * real).sum()
        acc[2] += real.sum()
    dist.all_reduce(acc)
    model.train()
    return (acc[0] / acc[2]).item(), (acc[1] / acc[2]).item()


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(0)

    tr_ids = np.load(os.path.join(args.data_dir, "train_ids.npy"), mmap_mode="r")
    te_ids = np.load(os.path.join(args.data_dir, "test_ids.npy"), mmap_mode="r")
    Y_tr = sp.load_npz(os.path.join(args.data_dir, "Y_train_freqsorted.npz")).tocsr()
    Y_te = sp.load_npz(os.path.join(args.data_dir, "Y_test_freqsorted.npz")).tocsr()
    num_labels = Y_tr.shape[1]

    train_ds = Titles(tr_ids, Y_tr, args.max_pos)
    padded = math.ceil(te_ids.shape[0] / world) * world
    test_ds = Subset(Titles(te_ids, Y_te, args.max_pos, n_rows=padded), range(rank, padded, world))
    sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    train_loader = DataLoader(train_ds, batch_size=args.global_batch_size // world, sampler=sampler,
                              num_workers=6, pin_memory=True, drop_last=True)
    test_loader = DataLoader(test_ds, batch_size=128, num_workers=2)

    net = TitleEncoder(args.vocab, args.d_model, args.layers, num_labels)
    model = FSDP(
        net,
        auto_wrap_policy=ModuleWrapPolicy({nn.TransformerEncoderLayer, nn.Embedding}),
        sharding_strategy=ShardingStrategy.FULL_SHARD,
        mixed_precision=MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
                                       buffer_dtype=torch.bfloat16),
        device_id=local_rank,
        sync_module_states=True,
        use_orig_params=True,
    )
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    total = args.epochs * len(train_loader)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min((s + 1) / args.warmup_steps, max(0.0, (total - s) / (total - args.warmup_steps))))

    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        t0 = time.time()
        for step, (ids, pos, first, _) in enumerate(train_loader):
            ids, pos, first = ids.to(device), pos.to(device), first.to(device)
            sampled = log_uniform_sample(args.num_sampled, num_labels, device)
            cand = torch.cat([first, sampled])
            logits = model(ids, cand).float()
            logits[:, ids.size(0):] -= log_q(sampled, num_labels)
            hits = (cand.unsqueeze(0).unsqueeze(-1) == pos.unsqueeze(1)).any(-1)
            target = torch.arange(ids.size(0), device=device)
            hits[target, target] = False
            loss = F.cross_entropy(logits.masked_fill(hits, float("-inf")), target)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            model.clip_grad_norm_(1.0)
            opt.step()
            sched.step()
            if rank == 0 and step % 200 == 0:
                print(f"ep {epoch} step {step}/{len(train_loader)} loss {loss.item():.4f} "
                      f"{time.time() - t0:.0f}s", flush=True)

        p1, p5 = evaluate(model, test_loader, device)
        if rank == 0:
            print(f"epoch {epoch} P@1 {p1:.4f} P@5 {p5:.4f}", flush=True)

        # every rank takes part in the all-gather; only rank 0 receives the full tensors
        with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT,
                                  FullStateDictConfig(offload_to_cpu=True, rank0_only=True),
                                  FullOptimStateDictConfig(offload_to_cpu=True, rank0_only=True)):
            model_state = model.state_dict()
            optim_state = FSDP.optim_state_dict(model, opt)
        if rank == 0:
            os.makedirs(args.out, exist_ok=True)
            torch.save({"model": model_state, "optim": optim_state, "epoch": epoch,
                        "P@1": p1, "P@5": p5}, os.path.join(args.out, f"epoch{epoch}.pt"))
            np.save(os.path.join(args.out, "label_emb.npy"),
                    model_state["label_emb.weight"].float().numpy())
        del model_state, optim_state
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
