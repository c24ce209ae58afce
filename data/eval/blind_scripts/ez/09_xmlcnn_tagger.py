#!/usr/bin/env python
"""XML-CNN (Liu et al. 2017) for the ~131K leaf-category tags of the catalog.

Long jobs get pre-empted on the shared queue, so the script checkpoints every
epoch and can pick up from --resume.

    torchrun --nproc_per_node=4 09_xmlcnn_tagger.py --cfg cfg/xmlcnn_leafcat.yaml \
        --resume /mnt/shared/tagging/runs/xmlcnn/last.pt
"""
import argparse
import contextlib
import os
import time

import numpy as np
import scipy.sparse as sp
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import yaml
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


class Docs(Dataset):
    def __init__(self, tokens, Y, rows=None):
        self.tokens, self.Y = tokens, Y
        self.rows = np.arange(tokens.shape[0]) if rows is None else rows

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        r = self.rows[i]
        return torch.from_numpy(np.asarray(self.tokens[r], dtype=np.int64)), int(r)


class XMLCNN(nn.Module):
    def __init__(self, vocab, emb_dim, num_labels, seq_len, filters=(2, 4, 8), n_filters=128,
                 pool_chunks=8, hidden=512, dropout=0.5, pretrained=None):
        super().__init__()
        self.emb = nn.Embedding(vocab, emb_dim, padding_idx=0)
        if pretrained is not None:
            self.emb.weight.data.copy_(torch.from_numpy(pretrained))
        self.convs = nn.ModuleList([nn.Conv1d(emb_dim, n_filters, k, padding=k // 2) for k in filters])
        self.pool = nn.AdaptiveMaxPool1d(pool_chunks)
        self.bottleneck = nn.Linear(len(filters) * n_filters * pool_chunks, hidden)
        self.drop = nn.Dropout(dropout)
        self.out = nn.Linear(hidden, num_labels)

    def forward(self, tokens):
        x = self.drop(self.emb(tokens)).transpose(1, 2)
        x = torch.cat([self.pool(F.relu(c(x))).flatten(1) for c in self.convs], dim=1)
        return self.out(self.drop(F.relu(self.bottleneck(x))))


def targets_from_rows(Y, rows, device):
    sub = Y[rows]
    t = torch.zeros(len(rows), Y.shape[1], device=device)
    r = torch.from_numpy(np.repeat(np.arange(len(rows)), np.diff(sub.indptr))).to(device)
    t[r, torch.from_numpy(sub.indices.astype(np.int64)).to(device)] = 1.0
    return t


@torch.no_grad()
def evaluate(net, loader, Y, device, ks=(1, 3, 5)):
    net.eval()
    disc = 1.0 / torch.log2(torch.arange(2, 7, device=device, dtype=torch.float64))
    acc = torch.zeros(2 * len(ks) + 1, device=device, dtype=torch.float64)
    for tokens, rows in loader:
        rows = rows.numpy()
        logits = net(tokens.to(device))
        t = targets_from_rows(Y, rows, device)
        top = logits.topk(max(ks), dim=1).indices
        hit = t.gather(1, top).double()
        npos = t.sum(1).double()
        for j, k in enumerate(ks):
            acc[j] += hit[:, :k].sum() / k
            ideal = torch.stack([disc[: int(min(k, m))].sum() if m > 0 else disc[:1].sum()
                                 for m in npos.tolist()])
            acc[len(ks) + j] += ((hit[:, :k] * disc[:k]).sum(1) / ideal).sum()
        acc[-1] += len(rows)
    dist.all_reduce(acc)
    net.train()
    acc = acc / acc[-1]
    return {**{f"P@{k}": acc[j].item() for j, k in enumerate(ks)},
            **{f"nDCG@{k}": acc[len(ks) + j].item() for j, k in enumerate(ks)}}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cfg", required=True)
    ap.add_argument("--resume", default=None)
    cli = ap.parse_args()
    with open(cli.cfg) as f:
        cfg = yaml.safe_load(f)

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(cfg.get("seed", 0))

    data = cfg["data_dir"]
    tr_tok = np.load(os.path.join(data, "train_tokens.npy"), mmap_mode="r")
    te_tok = np.load(os.path.join(data, "test_tokens.npy"), mmap_mode="r")
    Y_tr = sp.load_npz(os.path.join(data, "Y_train.npz")).tocsr()
    Y_te = sp.load_npz(os.path.join(data, "Y_test.npz")).tocsr()
    glove = np.load(os.path.join(data, "glove300.npy")) if cfg.get("glove", True) else None

    train_ds = Docs(tr_tok, Y_tr)
    test_ds = Docs(te_tok, Y_te, rows=np.arange(rank, te_tok.shape[0], world))
    accum = cfg.get("accum_steps", 1)
    micro_bs = cfg["global_batch_size"] // (world * accum)
    sampler = DistributedSampler(train_ds, shuffle=True, seed=cfg.get("seed", 0), drop_last=True)
    train_loader = DataLoader(train_ds, batch_size=micro_bs, sampler=sampler, num_workers=6,
                              pin_memory=True, drop_last=True)
    test_loader = DataLoader(test_ds, batch_size=512, num_workers=2)

    net = XMLCNN(tr_tok.max() + 1 if glove is None else glove.shape[0], 300, Y_tr.shape[1],
                 tr_tok.shape[1], pretrained=glove).to(device)
    opt = torch.optim.Adam(net.parameters(), lr=cfg.get("lr", 1e-3))
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=cfg.get("lr_step", 10), gamma=0.5)
    start_epoch, best = 0, 0.0
    if cli.resume and os.path.exists(cli.resume):
        ckpt = torch.load(cli.resume)
        net.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["optimizer"])
        sched.load_state_dict(ckpt["scheduler"])
        start_epoch, best = ckpt["epoch"] + 1, ckpt["best"]
        if rank == 0:
            print(f"resumed from {cli.resume} at epoch {start_epoch}", flush=True)
    model = DDP(net, device_ids=[local_rank])
    out_dir = cfg["output_dir"]

    for epoch in range(start_epoch, cfg["epochs"]):
        sampler.set_epoch(epoch)
        t0 = time.time()
        opt.zero_grad(set_to_none=True)
        for i, (tokens, rows) in enumerate(train_loader):
            tokens = tokens.to(device, non_blocking=True)
            target = targets_from_rows(Y_tr, rows.numpy(), device)
            last_micro = (i + 1) % accum == 0
            ctx = contextlib.nullcontext() if last_micro else model.no_sync()
            with ctx:
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    logits = model(tokens)
                loss = F.binary_cross_entropy_with_logits(logits.float(), target, reduction="sum")
                (loss / (tokens.size(0) * accum)).backward()
            if last_micro:
                opt.step()
                opt.zero_grad(set_to_none=True)
            if rank == 0 and i % 400 == 0:
                print(f"epoch {epoch} it {i} loss {loss.item() / tokens.size(0):.4f} "
                      f"({time.time() - t0:.0f}s)", flush=True)
        sched.step()

        res = evaluate(net, test_loader, Y_te, device)
        if rank == 0:
            print(f"epoch {epoch} " + " ".join(f"{k} {v:.4f}" for k, v in res.items()), flush=True)
            best = max(best, res["P@1"])
            os.makedirs(out_dir, exist_ok=True)
            state = {"model": net.state_dict(), "optimizer": opt.state_dict(),
                     "scheduler": sched.state_dict(), "epoch": epoch, "best": best}
            torch.save(state, os.path.join(out_dir, "last.pt"))
            if res["P@1"] >= best:
                torch.save(state, os.path.join(out_dir, "best.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
