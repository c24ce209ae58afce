"""
FedAvg next-character prediction on LEAF Shakespeare (one client per speaking role).

Each spawned process owns one GPU for local training. The server state lives on the
CPU and aggregation goes over gloo, which keeps the GPUs free for the clients and
lets the same script run on a CPU-only box with --no-cuda for debugging.

    python 13_fedavg_shakespeare_gloo.py --nprocs 4 --leaf /data/leaf/shakespeare/data
"""
import argparse
import glob
import json
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F

# LEAF's fixed character set, so every process maps characters identically
ALL_LETTERS = "\n !\"&'(),-.0123456789:;>?ABCDEFGHIJKLMNOPQRSTUVWXYZ[]abcdefghijklmnopqrstuvwxyz}"
CHAR2IDX = {c: i for i, c in enumerate(ALL_LETTERS)}
SEQ_LEN = 80


def encode(s):
    return [CHAR2IDX.get(c, 0) for c in s]


class CharLSTM(nn.Module):
    def __init__(self, vocab=len(ALL_LETTERS), emb=8, hidden=256):
        super().__init__()
        self.emb = nn.Embedding(vocab, emb)
        self.lstm = nn.LSTM(emb, hidden, num_layers=2, batch_first=True)
        self.fc = nn.Linear(hidden, vocab)

    def forward(self, x):
        h, _ = self.lstm(self.emb(x))
        return self.fc(h[:, -1])


def read_leaf(folder):
    users, data = [], {}
    for fn in sorted(glob.glob(os.path.join(folder, "*.json"))):
        with open(fn) as f:
            d = json.load(f)
        users += d["users"]
        data.update(d["user_data"])
    return users, data


def tensors(blob):
    x = torch.tensor([encode(s) for s in blob["x"]], dtype=torch.long)
    y = torch.tensor([CHAR2IDX.get(c, 0) for c in blob["y"]], dtype=torch.long)
    return x, y


def local_train(model, x, y, epochs, bs, lr, device):
    model.train()
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    x, y = x.to(device), y.to(device)
    for _ in range(epochs):
        perm = torch.randperm(len(y), device=device)
        for i in range(0, len(y), bs):
            b = perm[i:i + bs]
            loss = F.cross_entropy(model(x[b]), y[b])
            opt.zero_grad()
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 5.0)
            opt.step()
    return loss.item()


def run(rank, world_size, args):
    os.environ["MASTER_ADDR"] = args.master_addr
    os.environ["MASTER_PORT"] = str(args.master_port)
    use_cuda = torch.cuda.is_available() and not args.no_cuda
    if use_cuda:
        torch.cuda.set_device(rank % torch.cuda.device_count())
        device = torch.device("cuda", rank % torch.cuda.device_count())
    else:
        device = torch.device("cpu")
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    torch.manual_seed(args.seed + rank)

    users, train = read_leaf(os.path.join(args.leaf, "train"))
    _, test = read_leaf(os.path.join(args.leaf, "test"))
    users = [u for u in users if len(train[u]["y"]) >= args.min_samples]

    server = CharLSTM()  # CPU copy, identical on every rank after the broadcast below
    for t in server.state_dict().values():
        dist.broadcast(t, src=0)
    client = CharLSTM().to(device)

    start = 0
    ckpt_path = os.path.join(args.out, "server.pt")
    if os.path.exists(ckpt_path):
        ck = torch.load(ckpt_path, map_location="cpu")
        server.load_state_dict(ck["model"])
        start = ck["round"]

    for rnd in range(start, args.rounds):
        t0 = time.time()
        sel = np.random.default_rng(args.seed + rnd).choice(len(users), args.per_round, replace=False)
        mine = [users[i] for i in sel[rank::world_size]]

        sums = [torch.zeros_like(p) for p in server.parameters()]
        n_sum = torch.zeros(1)
        losses = {}
        for u in mine:
            client.load_state_dict(server.state_dict())
            x, y = tensors(train[u])
            losses[u] = local_train(client, x, y, args.local_epochs, args.bs, args.lr, device)
            for s, p in zip(sums, client.parameters()):
                s.add_(p.detach().cpu(), alpha=len(y))
            n_sum += len(y)

        # gloo reduces CPU tensors directly
        dist.all_reduce(n_sum)
        for s in sums:
            dist.all_reduce(s)
        with torch.no_grad():
            for p, s in zip(server.parameters(), sums):
                p.copy_(s / n_sum)

        gathered = [None] * world_size
        dist.all_gather_object(gathered, losses)
        if rank == 0 and rnd % 5 == 0:
            all_losses = [v for d in gathered for v in d.values()]
            print(f"round {rnd}: {len(all_losses)} clients, mean local loss {np.mean(all_losses):.3f}, "
                  f"{time.time() - t0:.1f}s", flush=True)

        if (rnd + 1) % args.eval_every == 0:
            client.load_state_dict(server.state_dict())
            client.eval()
            stats = torch.zeros(2)
            with torch.no_grad():
                for u in users[rank::world_size]:
                    x, y = tensors(test[u])
                    if len(y) == 0:
                        continue
                    pred = torch.cat([client(xb.to(device)).argmax(1).cpu() for xb in x.split(2048)])
                    stats += torch.tensor([(pred == y).sum().item(), len(y)], dtype=torch.float32)
            dist.all_reduce(stats)
            if rank == 0:
                print(f"== round {rnd + 1}: test acc {(stats[0] / stats[1]).item():.4f}", flush=True)
                os.makedirs(args.out, exist_ok=True)
                torch.save({"model": server.state_dict(), "round": rnd + 1}, ckpt_path + ".tmp")
                os.replace(ckpt_path + ".tmp", ckpt_path)
            dist.barrier()

    dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--leaf", default="/data/leaf/shakespeare/data")
    ap.add_argument("--out", default="out/shakespeare")
    ap.add_argument("--nprocs", type=int, default=max(torch.cuda.device_count(), 1))
    ap.add_argument("--rounds", type=int, default=200)
    ap.add_argument("--per-round", type=int, default=16)
    ap.add_argument("--local-epochs", type=int, default=1)
    ap.add_argument("--bs", type=int, default=10)
    ap.add_argument("--lr", type=float, default=0.8)
    ap.add_argument("--min-samples", type=int, default=64)
    ap.add_argument("--eval-every", type=int, default=10)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--master-addr", default="127.0.0.1")
    ap.add_argument("--master-port", type=int, default=29617)
    ap.add_argument("--no-cuda", action="store_true")
    args = ap.parse_args()
    mp.spawn(run, args=(args.nprocs, args), nprocs=args.nprocs, join=True)


if __name__ == "__main__":
    main()
