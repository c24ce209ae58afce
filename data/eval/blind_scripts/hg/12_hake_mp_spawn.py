"""HAKE (Zhang et al., AAAI 2020): hierarchy-aware KGE in polar coordinates.

Single-node multi-GPU training started with torch.multiprocessing.spawn:

    python 12_hake_mp_spawn.py --data_path data/WN18RR --gpus 4
"""
import argparse
import math
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data_path", default="data/WN18RR")
    p.add_argument("--save_path", default="models/HAKE_wn18rr")
    p.add_argument("--gpus", type=int, default=torch.cuda.device_count())
    p.add_argument("--port", type=int, default=29511)
    p.add_argument("--hidden_dim", type=int, default=500)
    p.add_argument("--gamma", type=float, default=6.0)
    p.add_argument("--modulus_weight", type=float, default=0.5)
    p.add_argument("--phase_weight", type=float, default=0.5)
    p.add_argument("--neg", type=int, default=1024)
    p.add_argument("--batch_size", type=int, default=128, help="per GPU")
    p.add_argument("--adv_temp", type=float, default=0.5)
    p.add_argument("--lr", type=float, default=5e-5)
    p.add_argument("--epochs", type=int, default=400)
    p.add_argument("--valid_every", type=int, default=50)
    return p.parse_args()


def cache_path(args):
    return os.path.join(args.data_path, "cached_ids.npz")


def build_cache(args):
    def vocab(fn):
        with open(os.path.join(args.data_path, fn)) as f:
            return {n: int(i) for i, n in (l.strip().split("\t") for l in f)}

    ents, rels = vocab("entities.dict"), vocab("relations.dict")
    arrays = {}
    for split in ("train", "valid", "test"):
        with open(os.path.join(args.data_path, f"{split}.txt")) as f:
            arrays[split] = np.array([(ents[h], rels[r], ents[t]) for h, r, t in
                                      (l.strip().split("\t") for l in f)], dtype=np.int64)
    tmp = cache_path(args) + ".tmp.npz"
    np.savez(tmp, n_ent=len(ents), n_rel=len(rels), **arrays)
    os.replace(tmp, cache_path(args))


class NegSampling(Dataset):
    def __init__(self, triples, n_ent, k):
        self.triples, self.n_ent, self.k = triples, n_ent, k

    def __len__(self):
        return len(self.triples)

    def __getitem__(self, i):
        return torch.from_numpy(self.triples[i]), torch.randint(self.n_ent, (self.k,)), torch.rand(()) < 0.5


class HAKE(nn.Module):
    def __init__(self, n_ent, n_rel, dim, gamma, modulus_weight, phase_weight):
        super().__init__()
        self.dim = dim
        self.gamma = gamma
        self.rng = (gamma + 2.0) / dim
        self.entity = nn.Parameter(torch.empty(n_ent, 2 * dim).uniform_(-self.rng, self.rng))
        rel = torch.empty(n_rel, 3 * dim).uniform_(-self.rng, self.rng)
        rel[:, dim:2 * dim] = 1.0    # modulus part
        rel[:, 2 * dim:] = 0.0       # bias part
        self.relation = nn.Parameter(rel)
        self.phase_weight = nn.Parameter(torch.tensor([[phase_weight * self.rng]]))
        self.modulus_weight = nn.Parameter(torch.tensor([[modulus_weight]]))

    def score(self, h, r, t):
        pi = math.pi
        ph_h, mod_h = h.chunk(2, dim=-1)
        ph_r, mod_r, bias_r = r.chunk(3, dim=-1)
        ph_t, mod_t = t.chunk(2, dim=-1)
        ph_h, ph_r, ph_t = (x / (self.rng / pi) for x in (ph_h, ph_r, ph_t))
        mod_r = mod_r.abs()
        bias_r = bias_r.clamp(max=1)
        bias_r = torch.where(bias_r < -mod_r, -mod_r, bias_r)
        r_score = (mod_h * (mod_r + bias_r) - mod_t * (1 - bias_r)).norm(dim=-1) * self.modulus_weight.squeeze()
        p_score = torch.sin((ph_h + ph_r - ph_t) / 2).abs().sum(-1) * self.phase_weight.squeeze()
        return self.gamma - (r_score + p_score)

    def forward(self, pos, neg, head_mode):
        h = self.entity[pos[:, 0]].unsqueeze(1)
        r = self.relation[pos[:, 1]].unsqueeze(1)
        t = self.entity[pos[:, 2]].unsqueeze(1)
        n = self.entity[neg]
        m = head_mode.view(-1, 1, 1)
        neg_score = self.score(torch.where(m, n, h), r, torch.where(m, t, n))
        return self.score(h, r, t).squeeze(1), neg_score


@torch.no_grad()
def evaluate(model, triples, filt, device, rank, world, bs=16):
    model.eval()
    mine = triples[rank::world]
    sums = torch.zeros(4, device=device, dtype=torch.float64)  # rr, h1, h10, n
    all_e = model.entity.unsqueeze(0)
    for i in range(0, len(mine), bs):
        b = torch.from_numpy(mine[i:i + bs]).to(device)
        h = model.entity[b[:, 0]].unsqueeze(1)
        r = model.relation[b[:, 1]].unsqueeze(1)
        t = model.entity[b[:, 2]].unsqueeze(1)
        for side in ("tail", "head"):
            s = model.score(h, r, all_e) if side == "tail" else model.score(all_e, r, t)
            gold_id = b[:, 2] if side == "tail" else b[:, 0]
            gold = s.gather(1, gold_id[:, None])
            for j, (hh, rr, tt) in enumerate(b.tolist()):
                s[j, filt[side][(hh, rr) if side == "tail" else (rr, tt)]] = -1e9
            rk = (s > gold).sum(1).double() + 1
            sums += torch.stack([(1 / rk).sum(), (rk <= 1).sum().double(), (rk <= 10).sum().double(),
                                 rk.new_tensor(len(rk))])
    dist.all_reduce(sums)
    model.train()
    return {"MRR": (sums[0] / sums[3]).item(), "H@1": (sums[1] / sums[3]).item(),
            "H@10": (sums[2] / sums[3]).item()}


def worker(rank, world_size, args):
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(args.port))
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world_size)
    device = torch.device("cuda", rank)

    if rank == 0 and not os.path.exists(cache_path(args)):
        build_cache(args)
    dist.barrier()
    cache = np.load(cache_path(args))
    n_ent, n_rel = int(cache["n_ent"]), int(cache["n_rel"])
    train, valid, test = cache["train"], cache["valid"], cache["test"]
    filt = {"tail": {}, "head": {}}
    for h, r, t in np.concatenate([train, valid, test]).tolist():
        filt["tail"].setdefault((h, r), []).append(t)
        filt["head"].setdefault((r, t), []).append(h)

    torch.manual_seed(2020)
    model = HAKE(n_ent, n_rel, args.hidden_dim, args.gamma, args.modulus_weight, args.phase_weight).to(device)
    ddp = DDP(model, device_ids=[rank])
    opt = torch.optim.Adam(ddp.parameters(), lr=args.lr)
    torch.manual_seed(2020 + rank)

    ds = NegSampling(train, n_ent, args.neg)
    sampler = DistributedSampler(ds, num_replicas=world_size, rank=rank, shuffle=True, seed=2020)
    loader = DataLoader(ds, batch_size=args.batch_size, sampler=sampler, num_workers=4, drop_last=True)
    if rank == 0:
        os.makedirs(args.save_path, exist_ok=True)
        print(f"[HAKE] {n_ent} entities {n_rel} relations {len(train)} train; {world_size} GPUs", flush=True)

    best = -1.0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        t0, acc = time.time(), torch.zeros(2, device=device)
        for pos, neg, head_mode in loader:
            pos, neg, head_mode = pos.to(device), neg.to(device), head_mode.to(device)
            p, n = ddp(pos, neg, head_mode)
            w = F.softmax(n * args.adv_temp, dim=1).detach()
            loss = (-F.logsigmoid(p).mean() - (w * F.logsigmoid(-n)).sum(1).mean()) / 2
            opt.zero_grad()
            loss.backward()
            opt.step()
            acc += torch.stack([loss.detach(), torch.ones((), device=device)])
        dist.all_reduce(acc)
        if rank == 0:
            print(f"epoch {epoch} loss {(acc[0] / acc[1]).item():.4f} {time.time() - t0:.0f}s", flush=True)

        if (epoch + 1) % args.valid_every == 0:
            m = evaluate(model, valid, filt, device, rank, world_size)
            if rank == 0:
                print(f"epoch {epoch} valid {m}", flush=True)
                if m["MRR"] > best:
                    best = m["MRR"]
                    torch.save({"model": model.state_dict(), "epoch": epoch},
                               os.path.join(args.save_path, "best.pt"))
            dist.barrier()

    state = torch.load(os.path.join(args.save_path, "best.pt"), map_location=device)
    model.load_state_dict(state["model"])
    m = evaluate(model, test, filt, device, rank, world_size)
    if rank == 0:
        print(f"test (epoch {state['epoch']}) {m}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    args = get_args()
    mp.spawn(worker, args=(args.gpus, args), nprocs=args.gpus, join=True)
