"""
SASRec, preemptible-cluster version: checkpoints every few epochs and resumes
from --resume (model, optimizer, scheduler, epoch, best metric).

Data format is the one of the original SASRec repo: one "user item" pair per
line, users and items already mapped to 1..N and sorted by time.

    torchrun --nproc_per_node=4 07_sasrec_resume_training.py --dataset data/Sports.txt \
        --run_dir runs/sasrec_sports --resume runs/sasrec_sports/latest.pt
"""
import argparse
import math
import os
import random
import sys
import time
from collections import defaultdict

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--dataset", required=True)
    p.add_argument("--run_dir", required=True)
    p.add_argument("--resume", default="")
    p.add_argument("--maxlen", type=int, default=50)
    p.add_argument("--hidden_units", type=int, default=64)
    p.add_argument("--num_blocks", type=int, default=2)
    p.add_argument("--num_heads", type=int, default=2)
    p.add_argument("--dropout_rate", type=float, default=0.2)
    p.add_argument("--batch_size", type=int, default=128, help="per process")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--num_epochs", type=int, default=300)
    p.add_argument("--save_every", type=int, default=5)
    p.add_argument("--eval_every", type=int, default=10)
    p.add_argument("--seed", type=int, default=1)
    return p.parse_args()


def data_partition(fname):
    user_items = defaultdict(list)
    n_user = n_item = 0
    with open(fname) as f:
        for line in f:
            u, i = map(int, line.split())
            n_user, n_item = max(n_user, u), max(n_item, i)
            user_items[u].append(i)
    train, valid, test = {}, {}, {}
    for u in range(1, n_user + 1):
        seq = user_items.get(u, [])
        if len(seq) < 3:
            train[u], valid[u], test[u] = seq, [], []
        else:
            train[u], valid[u], test[u] = seq[:-2], [seq[-2]], [seq[-1]]
    return train, valid, test, n_user, n_item


class TrainSeqs(Dataset):
    def __init__(self, train, n_item, maxlen):
        self.users = [u for u, s in train.items() if len(s) > 1]
        self.train = train
        self.n_item = n_item
        self.maxlen = maxlen

    def __len__(self):
        return len(self.users)

    def __getitem__(self, idx):
        s = self.train[self.users[idx]]
        ts = set(s)
        seq = np.zeros(self.maxlen, dtype=np.int64)
        pos = np.zeros(self.maxlen, dtype=np.int64)
        neg = np.zeros(self.maxlen, dtype=np.int64)
        nxt, j = s[-1], self.maxlen - 1
        for i in reversed(s[:-1]):
            seq[j], pos[j] = i, nxt
            t = random.randint(1, self.n_item)
            while t in ts:
                t = random.randint(1, self.n_item)
            neg[j] = t
            nxt, j = i, j - 1
            if j < 0:
                break
        return seq, pos, neg


class SASRec(nn.Module):
    def __init__(self, n_item, args):
        super().__init__()
        d = args.hidden_units
        self.item_emb = nn.Embedding(n_item + 1, d, padding_idx=0)
        self.pos_emb = nn.Embedding(args.maxlen, d)
        self.dropout = nn.Dropout(args.dropout_rate)
        layer = nn.TransformerEncoderLayer(d, args.num_heads, d, args.dropout_rate,
                                           batch_first=True, norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, args.num_blocks, enable_nested_tensor=False)
        self.final_ln = nn.LayerNorm(d, eps=1e-8)

    def log2feats(self, seq):
        L = seq.size(1)
        x = self.item_emb(seq) * self.item_emb.embedding_dim ** 0.5
        x = self.dropout(x + self.pos_emb(torch.arange(L, device=seq.device)))
        x = x * (seq > 0).unsqueeze(-1)
        mask = nn.Transformer.generate_square_subsequent_mask(L, device=seq.device)
        return self.final_ln(self.encoder(x, mask=mask, is_causal=True))

    def forward(self, seq, pos, neg):
        f = self.log2feats(seq)
        return (f * self.item_emb(pos)).sum(-1), (f * self.item_emb(neg)).sum(-1)

    def predict(self, seq, items):
        f = self.log2feats(seq)[:, -1]
        return (self.item_emb(items) @ f.unsqueeze(-1)).squeeze(-1)


@torch.no_grad()
def evaluate(net, dataset, users, args, split, device):
    train, valid, test, _, n_item = dataset
    net.eval()
    ndcg = hr = n = 0.0
    seqs, cands = [], []
    for u in users:
        if len(train[u]) < 1 or len(test[u]) < 1:
            continue
        hist = train[u] + (valid[u] if split == "test" else [])
        target = test[u][0] if split == "test" else valid[u][0]
        hist = hist[-args.maxlen:]
        seqs.append([0] * (args.maxlen - len(hist)) + hist)
        rated = set(train[u]) | {0} | set(valid[u]) | set(test[u])
        c = [target]
        while len(c) < 101:
            t = random.randint(1, n_item)
            if t not in rated:
                c.append(t)
        cands.append(c)
    for b in range(0, len(seqs), 512):
        s = torch.tensor(seqs[b:b + 512], device=device)
        c = torch.tensor(cands[b:b + 512], device=device)
        pred = -net.predict(s, c)
        rank = pred.argsort(1).argsort(1)[:, 0]
        hit = rank < 10
        hr += hit.sum().item()
        ndcg += (1.0 / torch.log2(rank[hit].float() + 2)).sum().item()
        n += len(s)
    t = torch.tensor([ndcg, hr, n], device=device, dtype=torch.float64)
    dist.all_reduce(t)
    net.train()
    return (t[0] / t[2]).item(), (t[1] / t[2]).item()


def save_checkpoint(path, net, opt, sched, epoch, best):
    tmp = path + ".tmp"
    torch.save({"model": net.state_dict(), "optimizer": opt.state_dict(), "scheduler": sched.state_dict(),
                "epoch": epoch, "best_ndcg": best}, tmp)
    os.replace(tmp, path)


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    random.seed(args.seed + rank)
    np.random.seed(args.seed + rank)
    torch.manual_seed(args.seed)

    dataset = data_partition(args.dataset)
    train, _, _, n_user, n_item = dataset
    ds = TrainSeqs(train, n_item, args.maxlen)
    sampler = DistributedSampler(ds, shuffle=True, seed=args.seed)
    loader = DataLoader(ds, batch_size=args.batch_size, sampler=sampler, num_workers=4, pin_memory=True)

    net = SASRec(n_item, args).to(device)
    for name, p in net.named_parameters():
        if p.dim() > 1:
            nn.init.xavier_normal_(p)
    model = DDP(net, device_ids=[local_rank])
    opt = torch.optim.Adam(model.parameters(), lr=args.lr * math.sqrt(world), betas=(0.9, 0.98))
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.num_epochs)
    bce = nn.BCEWithLogitsLoss()

    start_epoch, best = 1, 0.0
    if args.resume and os.path.isfile(args.resume):
        ckpt = torch.load(args.resume)
        net.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["optimizer"])
        sched.load_state_dict(ckpt["scheduler"])
        start_epoch, best = ckpt["epoch"] + 1, ckpt["best_ndcg"]
        if rank == 0:
            print(f"resumed from {args.resume} at epoch {start_epoch}", flush=True)

    writer = None
    if rank == 0:
        os.makedirs(args.run_dir, exist_ok=True)
        writer = SummaryWriter(os.path.join(args.run_dir, "tb"))

    eval_users = list(range(1 + rank, n_user + 1, world))
    for epoch in range(start_epoch, args.num_epochs + 1):
        sampler.set_epoch(epoch)
        t0 = time.time()
        loss_acc = torch.zeros(2, device=device)
        for seq, pos, neg in loader:
            seq, pos, neg = seq.to(device), pos.to(device), neg.to(device)
            pl, nl = model(seq, pos, neg)
            idx = pos != 0
            loss = bce(pl[idx], torch.ones_like(pl[idx])) + bce(nl[idx], torch.zeros_like(nl[idx]))
            opt.zero_grad()
            loss.backward()
            opt.step()
            loss_acc += torch.stack([loss.detach(), torch.ones((), device=device)])
        sched.step()
        dist.all_reduce(loss_acc)
        mean_loss = (loss_acc[0] / loss_acc[1]).item()
        if rank == 0:
            writer.add_scalar("train/loss", mean_loss, epoch)
            print(f"epoch {epoch} loss {mean_loss:.4f} time {time.time() - t0:.1f}s", flush=True)

        if epoch % args.eval_every == 0:
            v_ndcg, v_hr = evaluate(net, dataset, eval_users, args, "valid", device)
            t_ndcg, t_hr = evaluate(net, dataset, eval_users, args, "test", device)
            if rank == 0:
                writer.add_scalars("valid", {"NDCG@10": v_ndcg, "HR@10": v_hr}, epoch)
                writer.add_scalars("test", {"NDCG@10": t_ndcg, "HR@10": t_hr}, epoch)
                print(f"epoch {epoch} valid ({v_ndcg:.4f}, {v_hr:.4f}) test ({t_ndcg:.4f}, {t_hr:.4f})", flush=True)
                if v_ndcg > best:
                    best = v_ndcg
                    save_checkpoint(os.path.join(args.run_dir, "best.pt"), net, opt, sched, epoch, best)
            best = max(best, v_ndcg)

        if epoch % args.save_every == 0 and rank == 0:
            save_checkpoint(os.path.join(args.run_dir, "latest.pt"), net, opt, sched, epoch, best)
        dist.barrier()

    if writer is not None:
        writer.close()
    dist.destroy_process_group()
    sys.exit(0)


if __name__ == "__main__":
    main()
