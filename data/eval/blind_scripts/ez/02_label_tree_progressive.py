#!/usr/bin/env python
"""Two-level label tree for product tagging (cluster matcher + in-cluster ranker).

The label -> cluster assignment comes from the offline balanced k-means job
(tree.npz), so every worker sees the same tree. For the first --meta-epochs only
the cluster matcher is trained; after that the ranker is trained on the labels
of the shortlisted clusters.

    torchrun --standalone --nproc_per_node=8 02_label_tree_progressive.py \
        --data-dir /mnt/shared/tagging/catalog_v7 --output-dir /mnt/shared/tagging/runs/tree
"""
import argparse
import json
import os

import numpy as np
import scipy.sparse as sp
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data-dir", required=True)
    ap.add_argument("--output-dir", required=True)
    ap.add_argument("--dim", type=int, default=384)
    ap.add_argument("--meta-epochs", type=int, default=3)
    ap.add_argument("--epochs", type=int, default=15)
    ap.add_argument("--global-batch-size", type=int, default=2048)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--beam-train", type=int, default=16)
    ap.add_argument("--beam-eval", type=int, default=32)
    ap.add_argument("--max-pos", type=int, default=24)
    ap.add_argument("--resume", default=None)
    ap.add_argument("--seed", type=int, default=7)
    return ap.parse_args()


class TitleDataset(Dataset):
    def __init__(self, tokens, Y, max_pos):
        self.tokens, self.Y, self.max_pos = tokens, Y, max_pos

    def __len__(self):
        return self.tokens.shape[0]

    def __getitem__(self, i):
        labs = self.Y.indices[self.Y.indptr[i]:self.Y.indptr[i + 1]][: self.max_pos]
        pos = np.full(self.max_pos, -1, dtype=np.int64)
        pos[: len(labs)] = labs
        return torch.from_numpy(self.tokens[i].astype(np.int64)), torch.from_numpy(pos), i


class TreeXMC(nn.Module):
    def __init__(self, vocab_size, dim, num_clusters, num_labels):
        super().__init__()
        self.tok = nn.EmbeddingBag(vocab_size, dim, mode="mean", padding_idx=0)
        self.enc = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim),
                                 nn.LayerNorm(dim))
        self.meta = nn.Linear(dim, num_clusters)
        self.label_emb = nn.Embedding(num_labels + 1, dim, padding_idx=num_labels)

    def encode(self, tokens):
        return self.enc(self.tok(tokens))

    def forward(self, tokens, cand=None):
        h = self.encode(tokens)
        meta_logits = self.meta(h)
        if cand is None:
            return meta_logits, None
        rank_logits = torch.einsum("bd,bmd->bm", h, self.label_emb(cand))
        return meta_logits, rank_logits


def cluster_candidates(meta_scores, beam, cluster_table, pad_label):
    top_c = meta_scores.topk(beam, dim=1).indices             # [B, beam]
    cand = cluster_table[top_c].flatten(1)                      # [B, beam * S]
    return cand.masked_fill(cand < 0, pad_label)


@torch.no_grad()
def evaluate(net, loader, cluster_table, num_labels, beam, device, k=5):
    net.eval()
    sums = torch.zeros(2 * k + 1, dtype=torch.float64, device=device)
    discount = 1.0 / torch.log2(torch.arange(2, k + 2, device=device, dtype=torch.float64))
    preds = []
    for tokens, pos, rows in loader:
        tokens, pos = tokens.to(device), pos.to(device)
        meta_logits, _ = net(tokens)
        cand = cluster_candidates(meta_logits, beam, cluster_table, num_labels)
        _, scores = net(tokens, cand)
        scores = scores.masked_fill(cand == num_labels, float("-inf"))
        top = cand.gather(1, scores.topk(k, dim=1).indices)        # [B, k]
        hit = (top.unsqueeze(2) == pos.unsqueeze(1)).any(2).double()
        n_true = (pos >= 0).sum(1).clamp(max=k)
        cum_hit = hit.cumsum(1)
        dcg = (hit * discount).cumsum(1)
        idcg = discount.cumsum(0)
        for j in range(k):
            sums[j] += (cum_hit[:, j] / (j + 1)).sum()
            ideal = idcg[(n_true.clamp(max=j + 1) - 1).clamp(min=0)]
            sums[k + j] += torch.where(n_true > 0, dcg[:, j] / ideal, torch.zeros_like(ideal)).sum()
        sums[2 * k] += tokens.size(0)
        preds.extend(zip(rows.tolist(), top.cpu().tolist()))
    dist.all_reduce(sums)
    net.train()
    n = sums[2 * k].item()
    res = {f"P@{j + 1}": sums[j].item() / n for j in (0, 2, 4)}
    res.update({f"nDCG@{j + 1}": sums[k + j].item() / n for j in (0, 2, 4)})
    return res, preds


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{local_rank}")
    torch.manual_seed(args.seed)

    d = args.data_dir
    tr_tok = np.load(os.path.join(d, "train_tokens.npy"), mmap_mode="r")
    te_tok = np.load(os.path.join(d, "test_tokens.npy"), mmap_mode="r")
    Y_tr = sp.load_npz(os.path.join(d, "train_labels.npz")).tocsr()
    Y_te = sp.load_npz(os.path.join(d, "test_labels.npz")).tocsr()
    tree = np.load(os.path.join(d, "tree.npz"))
    label_to_cluster = torch.from_numpy(tree["label_to_cluster"]).long().to(device)
    cluster_table = torch.from_numpy(tree["cluster_table"]).long().to(device)   # [C, S], -1 padded
    num_labels, num_clusters = Y_tr.shape[1], cluster_table.shape[0]
    vocab_size = int(json.load(open(os.path.join(d, "meta.json")))["vocab_size"])

    train_ds = TitleDataset(tr_tok, Y_tr, args.max_pos)
    test_ds = Subset(TitleDataset(te_tok, Y_te, args.max_pos), range(rank, len(te_tok), world))
    sampler = DistributedSampler(train_ds, shuffle=True, seed=args.seed, drop_last=True)
    train_loader = DataLoader(train_ds, batch_size=args.global_batch_size // world, sampler=sampler,
                              num_workers=6, pin_memory=True, drop_last=True)
    test_loader = DataLoader(test_ds, batch_size=512, num_workers=4, pin_memory=True)

    net = TreeXMC(vocab_size, args.dim, num_clusters, num_labels).to(device)
    start_epoch = 0
    opt = torch.optim.Adam(net.parameters(), lr=args.lr)
    if args.resume:
        ckpt = torch.load(args.resume, map_location="cpu")
        net.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["opt"])
        start_epoch = ckpt["epoch"] + 1
    # the ranker is idle during the meta epochs, so DDP has to look for unused params
    model = DDP(net, device_ids=[local_rank], find_unused_parameters=True)

    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)
        train_ranker = epoch >= args.meta_epochs
        for it, (tokens, pos, _) in enumerate(train_loader):
            tokens = tokens.to(device, non_blocking=True)
            pos = pos.to(device, non_blocking=True)
            valid = pos >= 0
            pos_c = label_to_cluster[pos.clamp(min=0)]
            meta_t = torch.zeros(tokens.size(0), num_clusters, device=device)
            meta_t.scatter_add_(1, pos_c, valid.float()).clamp_(max=1.0)

            if not train_ranker:
                meta_logits, _ = model(tokens)
                loss = F.binary_cross_entropy_with_logits(meta_logits, meta_t)
            else:
                with torch.no_grad():
                    sel = net.meta(net.encode(tokens)) + 1e4 * meta_t
                cand = cluster_candidates(sel, args.beam_train, cluster_table, num_labels)
                meta_logits, rank_logits = model(tokens, cand)
                rank_t = (cand.unsqueeze(2) == pos.unsqueeze(1)).any(2).float()
                rank_mask = (cand != num_labels).float()
                loss = F.binary_cross_entropy_with_logits(meta_logits, meta_t) + \
                    (F.binary_cross_entropy_with_logits(rank_logits, rank_t, reduction="none")
                     * rank_mask).sum() / rank_mask.sum()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            if rank == 0 and it % 500 == 0:
                print(f"epoch {epoch} it {it} ranker={train_ranker} loss {loss.item():.4f}", flush=True)

        if train_ranker:
            res, preds = evaluate(net, test_loader, cluster_table, num_labels, args.beam_eval, device)
            gathered = [None] * world if rank == 0 else None
            dist.gather_object(preds, gathered, dst=0)
            if rank == 0:
                print(f"epoch {epoch} " + " ".join(f"{k}={v:.4f}" for k, v in res.items()), flush=True)
                os.makedirs(args.output_dir, exist_ok=True)
                with open(os.path.join(args.output_dir, f"test_top5_ep{epoch}.tsv"), "w") as f:
                    for row, top in sorted(p for part in gathered for p in part):
                        f.write(f"{row}\t{','.join(map(str, top))}\n")
        if rank == 0:
            os.makedirs(args.output_dir, exist_ok=True)
            torch.save({"model": net.state_dict(), "opt": opt.state_dict(), "epoch": epoch},
                       os.path.join(args.output_dir, "checkpoint.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
