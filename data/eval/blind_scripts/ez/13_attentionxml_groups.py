#!/usr/bin/env python
"""AttentionXML-style level-1 model: BiLSTM + label-wise attention over the
8192 tag groups (the first level of the tag tree). The leaf level is trained
separately on the group shortlist produced by this model.

    torchrun --nproc_per_node=8 13_attentionxml_groups.py \
        --data /mnt/shared/tagging/catalog_v7_words --emb /mnt/shared/tagging/glove.840B.300d.npy
"""
import argparse
import os
import time

import numpy as np
import scipy.sparse as sp
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


def args_parser():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--emb", required=True)
    ap.add_argument("--out", default="/mnt/shared/tagging/runs/attnxml_l1")
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--linear", type=int, default=256)
    ap.add_argument("--global-batch-size", type=int, default=512)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--epochs", type=int, default=15)
    ap.add_argument("--swa-start", type=int, default=8)
    ap.add_argument("--seed", type=int, default=5)
    return ap.parse_args()


class GroupDocs(Dataset):
    def __init__(self, tokens, lengths, Yg):
        self.tokens, self.lengths, self.Yg = tokens, lengths, Yg

    def __len__(self):
        return self.tokens.shape[0]

    def __getitem__(self, i):
        g = self.Yg.indices[self.Yg.indptr[i]:self.Yg.indptr[i + 1]]
        return (torch.from_numpy(self.tokens[i].astype(np.int64)), int(max(1, self.lengths[i])),
                torch.from_numpy(g.astype(np.int64)))


def collate(batch):
    toks, lens, groups = zip(*batch)
    rows = torch.cat([torch.full((len(g),), i, dtype=torch.long) for i, g in enumerate(groups)])
    return torch.stack(toks), torch.tensor(lens), rows, torch.cat(groups)


class AttentionXML(nn.Module):
    def __init__(self, emb_init, hidden, num_groups, linear):
        super().__init__()
        self.emb = nn.Embedding.from_pretrained(torch.from_numpy(emb_init).float(), freeze=False,
                                                padding_idx=0)
        self.drop = nn.Dropout(0.2)
        self.lstm = nn.LSTM(emb_init.shape[1], hidden, batch_first=True, bidirectional=True)
        self.attn = nn.Linear(2 * hidden, num_groups, bias=False)
        self.fc = nn.Sequential(nn.Linear(2 * hidden, linear), nn.ReLU(), nn.Linear(linear, 1))

    def forward(self, tokens, lengths):
        x = self.drop(self.emb(tokens))
        packed = pack_padded_sequence(x, lengths.cpu(), batch_first=True, enforce_sorted=False)
        h, _ = pad_packed_sequence(self.lstm(packed)[0], batch_first=True, total_length=tokens.size(1))
        mask = (tokens != 0).unsqueeze(-1)                          # [B, T, 1]
        a = self.attn(h).masked_fill(~mask, -1e4).softmax(dim=1)   # [B, T, G]
        ctx = torch.einsum("btg,bth->bgh", a, h)                    # [B, G, 2H]
        return self.fc(ctx).squeeze(-1)                             # [B, G]


def multi_hot(n, rows, cols, width, device):
    t = torch.zeros(n, width, device=device)
    t[rows.to(device), cols.to(device)] = 1.0
    return t


@torch.no_grad()
def evaluate(net, loader, num_groups, device, ks=(1, 3, 5, 10)):
    net.eval()
    sums = torch.zeros(len(ks) + 2, dtype=torch.float64, device=device)
    for toks, lens, rows, cols in loader:
        toks = toks.to(device)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            scores = net(toks, lens)
        t = multi_hot(toks.size(0), rows, cols, num_groups, device)
        top = scores.float().topk(100, dim=1).indices
        hit = t.gather(1, top).double()
        for j, k in enumerate(ks):
            sums[j] += hit[:, :k].sum() / k
        # recall of the 100-group shortlist handed to the leaf level
        sums[-2] += (hit.sum(1) / t.sum(1).clamp(min=1).double()).sum()
        sums[-1] += toks.size(0)
    dist.all_reduce(sums)
    net.train()
    out = {f"P@{k}": (sums[j] / sums[-1]).item() for j, k in enumerate(ks)}
    out["R@100"] = (sums[-2] / sums[-1]).item()
    return out


def main():
    args = args_parser()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{local_rank}")
    torch.manual_seed(args.seed)

    tr_tok = np.load(os.path.join(args.data, "train_words.npy"), mmap_mode="r")
    tr_len = np.load(os.path.join(args.data, "train_len.npy"))
    te_tok = np.load(os.path.join(args.data, "test_words.npy"), mmap_mode="r")
    te_len = np.load(os.path.join(args.data, "test_len.npy"))
    Yg_tr = sp.load_npz(os.path.join(args.data, "Y_train_groups.npz")).tocsr()
    Yg_te = sp.load_npz(os.path.join(args.data, "Y_test_groups.npz")).tocsr()
    num_groups = Yg_tr.shape[1]
    emb_init = np.load(args.emb)

    train_ds = GroupDocs(tr_tok, tr_len, Yg_tr)
    test_ds = torch.utils.data.Subset(GroupDocs(te_tok, te_len, Yg_te),
                                      np.arange(rank, te_tok.shape[0], world))
    train_sampler = DistributedSampler(train_ds, num_replicas=world, rank=rank, shuffle=True,
                                       seed=args.seed, drop_last=True)
    train_loader = DataLoader(train_ds, batch_size=args.global_batch_size // world,
                              sampler=train_sampler, collate_fn=collate, num_workers=4,
                              pin_memory=True, drop_last=True, persistent_workers=True)
    test_loader = DataLoader(test_ds, batch_size=256, collate_fn=collate, num_workers=2)

    net = AttentionXML(emb_init, args.hidden, num_groups, args.linear).to(device)
    model = DDP(net, device_ids=[local_rank])
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    swa = torch.optim.swa_utils.AveragedModel(net)

    for epoch in range(args.epochs):
        model.train()
        t0, seen = time.time(), 0
        for step, (toks, lens, rows, cols) in enumerate(train_loader):
            toks = toks.to(device, non_blocking=True)
            target = multi_hot(toks.size(0), rows, cols, num_groups, device)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = model(toks, lens)
            loss = F.binary_cross_entropy_with_logits(logits.float(), target)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 5.0)
            opt.step()
            seen += toks.size(0) * world
            if rank == 0 and step % 200 == 0:
                print(f"epoch {epoch} step {step} loss {loss.item():.5f} "
                      f"{seen / (time.time() - t0):.0f} docs/s", flush=True)
        if epoch >= args.swa_start:
            swa.update_parameters(net)

        eval_net = swa.module if epoch >= args.swa_start else net
        res = evaluate(eval_net, test_loader, num_groups, device)
        if rank == 0:
            print(f"epoch {epoch} " + " ".join(f"{k}={v:.4f}" for k, v in res.items()), flush=True)
            os.makedirs(args.out, exist_ok=True)
            torch.save({"model": eval_net.state_dict(), "epoch": epoch, "res": res},
                       os.path.join(args.out, "level1.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
