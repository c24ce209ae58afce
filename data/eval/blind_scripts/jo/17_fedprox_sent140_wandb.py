"""FedProx on LEAF Sent140 (one client per Twitter user), LSTM over GloVe embeddings.

    torchrun --nnodes=2 --nproc_per_node=4 --rdzv_backend=c10d --rdzv_endpoint=node001:29400 \
        17_fedprox_sent140_wandb.py --wandb-project fl-sent140 --run-name prox_mu0.01
"""
import argparse
import glob
import json
import os
import re

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import wandb

TOKEN_RE = re.compile(r"[a-z0-9']+")
MAX_LEN = 25


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--leaf", default="/shared/data/leaf/sent140/data")
    ap.add_argument("--glove", default="/shared/data/glove/glove.6B.300d.npz")
    ap.add_argument("--out", default="/shared/exp/sent140")
    ap.add_argument("--wandb-project", default="fl-sent140")
    ap.add_argument("--run-name", default=None)
    ap.add_argument("--rounds", type=int, default=800)
    ap.add_argument("--per-round", type=int, default=32)
    ap.add_argument("--local-epochs", type=int, default=1)
    ap.add_argument("--bs", type=int, default=10)
    ap.add_argument("--lr", type=float, default=0.3)
    ap.add_argument("--mu", type=float, default=0.01)
    ap.add_argument("--seed", type=int, default=4)
    ap.add_argument("--eval-every", type=int, default=20)
    return ap.parse_args()


def load_leaf(d):
    users, data = [], {}
    for fn in sorted(glob.glob(os.path.join(d, "*.json"))):
        with open(fn) as f:
            j = json.load(f)
        users += j["users"]
        data.update(j["user_data"])
    return users, data


def tokenize(text, vocab):
    ids = [vocab.get(t, 1) for t in TOKEN_RE.findall(text.lower())][:MAX_LEN]
    return ids + [0] * (MAX_LEN - len(ids))


def user_tensors(blob, vocab):
    # LEAF sent140 rows: x = [id, date, query, user, text], y = 0/1
    x = torch.tensor([tokenize(row[4], vocab) for row in blob["x"]], dtype=torch.long)
    y = torch.tensor(blob["y"], dtype=torch.long)
    return x, y


class SentLSTM(nn.Module):
    def __init__(self, emb_matrix, hidden=100):
        super().__init__()
        self.emb = nn.Embedding.from_pretrained(emb_matrix, freeze=True, padding_idx=0)
        self.lstm = nn.LSTM(emb_matrix.shape[1], hidden, num_layers=2, batch_first=True)
        self.fc = nn.Linear(hidden, 2)

    def forward(self, x):
        lengths = (x != 0).sum(1).clamp(min=1)
        h, _ = self.lstm(self.emb(x))
        last = h[torch.arange(x.size(0), device=x.device), lengths - 1]
        return self.fc(last)


def fedprox_local(model, anchor, x, y, epochs, bs, lr, mu):
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.SGD(params, lr=lr)
    for _ in range(epochs):
        order = torch.randperm(len(y), device=y.device)
        for i in range(0, len(y), bs):
            b = order[i:i + bs]
            loss = F.cross_entropy(model(x[b]), y[b])
            loss = loss + mu / 2 * sum((p - a).pow(2).sum() for p, a in zip(params, anchor))
            opt.zero_grad()
            loss.backward()
            opt.step()


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", local_rank)
    torch.manual_seed(args.seed)

    wandb.init(project=args.wandb_project, name=args.run_name, config=vars(args))

    glove = np.load(args.glove)
    words = glove["words"].tolist()
    vocab = {w: i + 2 for i, w in enumerate(words)}   # 0 = pad, 1 = unk
    emb = torch.zeros(len(words) + 2, glove["vectors"].shape[1])
    emb[2:] = torch.from_numpy(glove["vectors"]).float()

    users, train = load_leaf(os.path.join(args.leaf, "train"))
    _, test = load_leaf(os.path.join(args.leaf, "test"))

    model = SentLSTM(emb).to(dev)
    local = SentLSTM(emb).to(dev)
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    for n, p in model.named_parameters():
        if p.requires_grad:
            dist.broadcast(p.data, 0)

    for rnd in range(args.rounds):
        rng = np.random.default_rng((args.seed, rnd))
        chosen = rng.choice(len(users), args.per_round, replace=False)
        anchor = [p.detach().clone() for n, p in model.named_parameters() if n in trainable]
        sums = [torch.zeros_like(a) for a in anchor]
        n_tot = torch.zeros(1, device=dev)
        for i in chosen[rank::world]:
            x, y = user_tensors(train[users[i]], vocab)
            x, y = x.to(dev), y.to(dev)
            local.load_state_dict({k: v for k, v in model.state_dict().items() if k in trainable}, strict=False)
            fedprox_local(local, anchor, x, y, args.local_epochs, args.bs, args.lr, args.mu)
            for s, (n, p) in zip(sums, [(n, p) for n, p in local.named_parameters() if n in trainable]):
                s.add_(p.detach(), alpha=len(y))
            n_tot += len(y)

        dist.all_reduce(n_tot)
        with torch.no_grad():
            tparams = [p for n, p in model.named_parameters() if n in trainable]
            for s, p in zip(sums, tparams):
                dist.all_reduce(s)
                p.copy_(s / n_tot)

        if (rnd + 1) % args.eval_every == 0:
            model.eval()
            st = torch.zeros(3, device=dev)  # correct, count, loss sum
            with torch.no_grad():
                for u in users[rank::world]:
                    x, y = user_tensors(test[u], vocab)
                    if len(y) == 0:
                        continue
                    x, y = x.to(dev), y.to(dev)
                    logits = model(x)
                    st[0] += (logits.argmax(1) == y).sum()
                    st[1] += len(y)
                    st[2] += F.cross_entropy(logits, y, reduction="sum")
            dist.all_reduce(st)
            acc, loss = (st[0] / st[1]).item(), (st[2] / st[1]).item()
            wandb.log({"round": rnd + 1, "test/acc": acc, "test/loss": loss})
            if rank == 0:
                print(f"round {rnd + 1}: acc {acc:.4f} loss {loss:.4f}", flush=True)
                os.makedirs(args.out, exist_ok=True)
                torch.save({k: v for k, v in model.state_dict().items() if k in trainable},
                           os.path.join(args.out, f"{args.run_name or 'sent140'}_global.pt"))

    wandb.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
