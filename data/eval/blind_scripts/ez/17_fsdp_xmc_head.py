#!/usr/bin/env python
"""Multilingual marketplace tagger: XLM-R large + 2M-tag classifier table under FSDP.

Each product comes with a 200-tag shortlist from the previous production model
(shortlist_*.npy); the classifier is trained on positives + shortlist negatives.

    torchrun --nproc_per_node=8 17_fsdp_xmc_head.py --config configs/xlmr_large_2m.yaml
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
import yaml
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    CheckpointImpl, apply_activation_checkpointing, checkpoint_wrapper)
from torch.distributed.fsdp import FullStateDictConfig, MixedPrecision, StateDictType
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoModel
from transformers.models.xlm_roberta.modeling_xlm_roberta import XLMRobertaLayer


class ShortlistDocs(Dataset):
    def __init__(self, ids, Y, shortlist, max_pos, total=None):
        self.ids, self.Y, self.sl, self.max_pos = ids, Y, shortlist, max_pos
        self.total = ids.shape[0] if total is None else total

    def __len__(self):
        return self.total

    def __getitem__(self, i):
        real = i < self.ids.shape[0]
        r = i if real else 0
        labs = self.Y.indices[self.Y.indptr[r]:self.Y.indptr[r + 1]][: self.max_pos]
        pos = np.full(self.max_pos, -1, dtype=np.int64)
        pos[: len(labs)] = labs
        return (torch.from_numpy(self.ids[r].astype(np.int64)), torch.from_numpy(pos),
                torch.from_numpy(self.sl[r].astype(np.int64)), real)


class TagClassifier(nn.Module):
    def __init__(self, encoder_path, num_labels):
        super().__init__()
        self.encoder = AutoModel.from_pretrained(encoder_path, add_pooling_layer=False)
        d = self.encoder.config.hidden_size
        self.w = nn.Embedding(num_labels, d)
        self.b = nn.Embedding(num_labels, 1)
        nn.init.normal_(self.w.weight, std=0.02)
        nn.init.zeros_(self.b.weight)

    def forward(self, ids, cand):
        mask = (ids != 1).long()                   # XLM-R pad id
        h = self.encoder(input_ids=ids, attention_mask=mask).last_hidden_state[:, 0]
        return torch.einsum("bd,bkd->bk", h, self.w(cand)) + self.b(cand).squeeze(-1)


def save_full_checkpoint(model, path, rank):
    if rank == 0:
        cfg = FullStateDictConfig(offload_to_cpu=True, rank0_only=True)
        with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, cfg):
            state = model.state_dict()
        torch.save(state, path)
    dist.barrier()


@torch.no_grad()
def evaluate(model, loader, device, k=5):
    model.eval()
    acc = torch.zeros(4, dtype=torch.float64, device=device)
    for ids, pos, sl, real in loader:
        ids, pos, sl, real = ids.to(device), pos.to(device), sl.to(device), real.to(device).double()
        scores = model(ids, sl).float()
        top = sl.gather(1, scores.topk(k, dim=1).indices)
        hit = (top.unsqueeze(-1) == pos.unsqueeze(1)).any(-1).double()
        acc[0] += (hit[:, 0] * real).sum()
        acc[1] += (hit[:, :3].mean(1) * real).sum()
        acc[2] += (hit.mean(1) * real).sum()
        acc[3] += real.sum()
    dist.all_reduce(acc)
    model.train()
    return {"P@1": (acc[0] / acc[3]).item(), "P@3": (acc[1] / acc[3]).item(),
            "P@5": (acc[2] / acc[3]).item()}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", required=True)
    with open(ap.parse_args().config) as f:
        cfg = yaml.safe_load(f)

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(cfg.get("seed", 0))

    d = cfg["data_dir"]
    ids_tr = np.load(f"{d}/train_ids.npy", mmap_mode="r")
    ids_te = np.load(f"{d}/test_ids.npy", mmap_mode="r")
    sl_tr = np.load(f"{d}/shortlist_train.npy", mmap_mode="r")
    sl_te = np.load(f"{d}/shortlist_test.npy", mmap_mode="r")
    Y_tr = sp.load_npz(f"{d}/Y_train.npz").tocsr()
    Y_te = sp.load_npz(f"{d}/Y_test.npz").tocsr()
    num_labels = Y_tr.shape[1]
    max_pos = cfg.get("max_pos", 16)

    train_ds = ShortlistDocs(ids_tr, Y_tr, sl_tr, max_pos)
    padded = math.ceil(ids_te.shape[0] / world) * world
    test_ds = Subset(ShortlistDocs(ids_te, Y_te, sl_te, max_pos, total=padded), range(rank, padded, world))
    sampler = DistributedSampler(train_ds, shuffle=True, seed=cfg.get("seed", 0), drop_last=True)
    train_loader = DataLoader(train_ds, batch_size=cfg["global_batch_size"] // world, sampler=sampler,
                              num_workers=6, pin_memory=True, drop_last=True)
    test_loader = DataLoader(test_ds, batch_size=128, num_workers=2)

    net = TagClassifier(cfg["encoder"], num_labels)
    wrap = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={XLMRobertaLayer})
    model = FSDP(net, auto_wrap_policy=wrap, device_id=local_rank, use_orig_params=True,
                 mixed_precision=MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
                                                buffer_dtype=torch.bfloat16))
    apply_activation_checkpointing(
        model, check_fn=lambda m: isinstance(m, XLMRobertaLayer),
        checkpoint_wrapper_fn=functools.partial(checkpoint_wrapper,
                                                checkpoint_impl=CheckpointImpl.NO_REENTRANT))
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.get("lr", 2e-5), weight_decay=0.01)
    total = cfg["epochs"] * len(train_loader)
    warm = int(0.03 * total)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: (s + 1) / warm if s < warm else 0.5 * (1 + math.cos(math.pi * (s - warm) / (total - warm))))

    for epoch in range(cfg["epochs"]):
        sampler.set_epoch(epoch)
        t0 = time.time()
        for step, (ids, pos, sl, _) in enumerate(train_loader):
            ids, pos, sl = ids.to(device), pos.to(device), sl.to(device)
            in_pos = (sl.unsqueeze(-1) == pos.unsqueeze(1)).any(-1)
            cand = torch.cat([pos.clamp(min=0), sl], dim=1)
            target = torch.cat([(pos >= 0).float(), in_pos.float()], dim=1)
            weight = torch.cat([(pos >= 0).float(), (~in_pos).float()], dim=1)
            logits = model(ids, cand).float()
            loss = (F.binary_cross_entropy_with_logits(logits, target, reduction="none") * weight).sum()
            loss = loss / weight.sum()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            model.clip_grad_norm_(1.0)
            opt.step()
            sched.step()
            if rank == 0 and step % 100 == 0:
                print(f"epoch {epoch} step {step}/{len(train_loader)} loss {loss.item():.4f} "
                      f"({time.time() - t0:.0f}s)", flush=True)

        res = evaluate(model, test_loader, device)
        if rank == 0:
            print(f"epoch {epoch} " + " ".join(f"{k}={v:.4f}" for k, v in res.items()), flush=True)
            os.makedirs(cfg["output_dir"], exist_ok=True)
        save_full_checkpoint(model, os.path.join(cfg["output_dir"], f"epoch{epoch}.pt"), rank)

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
