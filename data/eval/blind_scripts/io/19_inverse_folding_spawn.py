"""Structure-conditioned sequence design (inverse folding) on CATH 4.2, PiFold-style one-shot decoder.

Single node, one process per GPU started with torch.multiprocessing.spawn:

    python 19_inverse_folding_spawn.py --data_dir data/cath4.2 --gpus 8 --wandb_project invfold
"""
import argparse
import json
import math
import os

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

AA = "ACDEFGHIKLMNPQRSTVWY"
AA_IDX = {a: i for i, a in enumerate(AA)}


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data_dir", required=True)
    ap.add_argument("--gpus", type=int, default=torch.cuda.device_count())
    ap.add_argument("--port", type=str, default="29533")
    ap.add_argument("--max_len", type=int, default=500)
    ap.add_argument("--k", type=int, default=30)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--batch_size", type=int, default=8)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--epochs", type=int, default=100)
    ap.add_argument("--label_smoothing", type=float, default=0.1)
    ap.add_argument("--ckpt", default="runs/invfold/last.pt")
    ap.add_argument("--wandb_project", default=None)
    return ap.parse_args()


def build_cache(data_dir, max_len):
    """chain_set.jsonl -> {name: (seq idx LongTensor, coords L x 4 x 3)} plus the split lists."""
    chains = {}
    with open(os.path.join(data_dir, "chain_set.jsonl")) as f:
        for line in f:
            e = json.loads(line)
            if len(e["seq"]) > max_len or any(a not in AA_IDX for a in e["seq"]):
                continue
            xyz = np.stack([np.asarray(e["coords"][a], dtype=np.float32) for a in ("N", "CA", "C", "O")], 1)
            chains[e["name"]] = (torch.tensor([AA_IDX[a] for a in e["seq"]]), torch.from_numpy(xyz))
    with open(os.path.join(data_dir, "chain_set_splits.json")) as f:
        splits = json.load(f)
    return {"chains": chains, "splits": {k: [n for n in v if n in chains] for k, v in splits.items()}}


class CATHSet(Dataset):
    def __init__(self, chains, names):
        self.chains, self.names = chains, names

    def __len__(self):
        return len(self.names)

    def __getitem__(self, i):
        return self.chains[self.names[i]]


def collate(batch):
    L = max(s.shape[0] for s, _ in batch)
    seq = torch.zeros(len(batch), L, dtype=torch.long)
    X = torch.zeros(len(batch), L, 4, 3)
    mask = torch.zeros(len(batch), L)
    for b, (s, x) in enumerate(batch):
        n = s.shape[0]
        seq[b, :n], X[b, :n], mask[b, :n] = s, x, 1.0
    finite = torch.isfinite(X).all(-1).all(-1)
    mask = mask * finite.float()
    X = torch.nan_to_num(X)
    return seq, X, mask


def rbf(d, n=16, d_min=2.0, d_max=22.0):
    mu = torch.linspace(d_min, d_max, n, device=d.device)
    return torch.exp(-((d[..., None] - mu) / ((d_max - d_min) / n)) ** 2)


class MPNNLayer(nn.Module):
    def __init__(self, h):
        super().__init__()
        self.msg = nn.Sequential(nn.Linear(3 * h, h), nn.GELU(), nn.Linear(h, h), nn.GELU(), nn.Linear(h, h))
        self.norm1, self.norm2 = nn.LayerNorm(h), nn.LayerNorm(h)
        self.ff = nn.Sequential(nn.Linear(h, 4 * h), nn.GELU(), nn.Linear(4 * h, h))
        self.edge_upd = nn.Sequential(nn.Linear(3 * h, h), nn.GELU(), nn.Linear(h, h))
        self.norm_e = nn.LayerNorm(h)

    def forward(self, hv, he, nbr, mask_attend):
        hj = torch.gather(hv.unsqueeze(1).expand(-1, hv.shape[1], -1, -1), 2,
                          nbr.unsqueeze(-1).expand(-1, -1, -1, hv.shape[-1]))
        m = self.msg(torch.cat([hv.unsqueeze(2).expand_as(hj), he, hj], -1)) * mask_attend.unsqueeze(-1)
        hv = self.norm1(hv + m.sum(2) / 30.0)
        hv = self.norm2(hv + self.ff(hv))
        hj = torch.gather(hv.unsqueeze(1).expand(-1, hv.shape[1], -1, -1), 2,
                          nbr.unsqueeze(-1).expand(-1, -1, -1, hv.shape[-1]))
        he = self.norm_e(he + self.edge_upd(torch.cat([hv.unsqueeze(2).expand_as(hj), he, hj], -1)))
        return hv, he


class InverseFoldingNet(nn.Module):
    def __init__(self, hidden, layers, k):
        super().__init__()
        self.k = k
        self.node_in = nn.Linear(6 * 16 + 12, hidden)
        self.edge_in = nn.Linear(16 * 16 + 16, hidden)
        self.layers = nn.ModuleList([MPNNLayer(hidden) for _ in range(layers)])
        self.out = nn.Linear(hidden, len(AA))

    def features(self, X, mask):
        N, CA, C = X[:, :, 0], X[:, :, 1], X[:, :, 2]
        b, c = CA - N, C - CA
        CB = -0.58273431 * torch.cross(b, c, dim=-1) + 0.56802827 * b - 0.54067466 * c + CA
        atoms = torch.stack([N, CA, C, X[:, :, 3], CB], 2)[:, :, [0, 1, 2, 4]]   # drop O for edges
        d_ca = torch.cdist(CA, CA) + (1 - mask[:, None, :] * mask[:, :, None]) * 1e6
        d_nbr, nbr = d_ca.topk(min(self.k, CA.shape[1]), dim=-1, largest=False)
        B, L, K = nbr.shape
        aj = torch.gather(atoms.unsqueeze(1).expand(-1, L, -1, -1, -1), 2,
                          nbr[..., None, None].expand(-1, -1, -1, 4, 3))        # B L K 4 3
        pair_d = torch.linalg.norm(atoms[:, :, None, :, None] - aj[:, :, :, None], dim=-1)   # B L K 4 4
        rel = (nbr - torch.arange(L, device=X.device)[None, :, None]).clamp(-32, 32).float()
        e = torch.cat([rbf(pair_d).flatten(-3), rbf(rel, 16, -32, 32)], -1)
        intra = torch.linalg.norm(atoms[:, :, :, None] - atoms[:, :, None], dim=-1)[:, :, [0, 0, 1, 1, 2, 0],
                                                                                 [1, 2, 2, 3, 3, 3]]
        v = torch.cat([rbf(intra, 16, 0.5, 4.5).flatten(-2), torch.cos(intra), torch.sin(intra)], -1)
        return v, e, nbr, d_nbr < 1e5

    def forward(self, X, mask):
        v, e, nbr, attend = self.features(X, mask)
        hv, he = self.node_in(v), self.edge_in(e)
        for layer in self.layers:
            hv, he = layer(hv, he, nbr, attend.float())
        return self.out(hv)


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    s = torch.zeros(3, device=device, dtype=torch.float64)    # nll sum, correct, residues
    for seq, X, mask in loader:
        seq, X, mask = seq.to(device), X.to(device), mask.to(device)
        logits = model(X, mask).float()
        nll = F.cross_entropy(logits.transpose(1, 2), seq, reduction="none")
        s[0] += (nll * mask).sum()
        s[1] += ((logits.argmax(-1) == seq).float() * mask).sum()
        s[2] += mask.sum()
    dist.all_reduce(s)
    model.train()
    return math.exp(s[0].item() / s[2].item()), s[1].item() / s[2].item()


def train_worker(local_rank, world_size, args):
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl", rank=local_rank, world_size=world_size)
    device = torch.device("cuda", local_rank)
    torch.manual_seed(0)

    cache_path = os.path.join(args.data_dir, f"cath_cache_L{args.max_len}.pt")
    if local_rank == 0 and not os.path.exists(cache_path):
        torch.save(build_cache(args.data_dir, args.max_len), cache_path + ".tmp")
        os.replace(cache_path + ".tmp", cache_path)
    dist.barrier()                   # the others wait until the cache is complete
    data = torch.load(cache_path, map_location="cpu")

    train_set = CATHSet(data["chains"], data["splits"]["train"])
    val_set = CATHSet(data["chains"], data["splits"]["validation"])
    sampler = DistributedSampler(train_set, num_replicas=world_size, rank=local_rank, shuffle=True)
    loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler, collate_fn=collate,
                        num_workers=4, drop_last=True)
    val_sampler = DistributedSampler(val_set, num_replicas=world_size, rank=local_rank, shuffle=False,
                                     drop_last=True)
    val_loader = DataLoader(val_set, batch_size=args.batch_size, sampler=val_sampler, collate_fn=collate,
                            num_workers=2)

    model = InverseFoldingNet(args.hidden, args.layers, args.k).to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr, betas=(0.9, 0.98))
    start_epoch = 0
    if os.path.exists(args.ckpt):
        ckpt = torch.load(args.ckpt, map_location=device)
        model.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        start_epoch = ckpt["epoch"] + 1
    model = DDP(model, device_ids=[local_rank])

    run = None
    if local_rank == 0 and args.wandb_project:
        import wandb
        run = wandb.init(project=args.wandb_project, config=vars(args))

    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)
        tot = torch.zeros(2, device=device)
        for seq, X, mask in loader:
            seq, X, mask = seq.to(device), X.to(device), mask.to(device)
            logits = model(X, mask)
            nll = F.cross_entropy(logits.transpose(1, 2), seq, reduction="none",
                                  label_smoothing=args.label_smoothing)
            loss = (nll * mask).sum() / mask.sum().clamp(min=1)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            tot += torch.stack([loss.detach(), torch.ones((), device=device)])
        dist.all_reduce(tot)
        ppl, rec = evaluate(model, val_loader, device)
        if local_rank == 0:
            print(f"epoch {epoch}: train loss {(tot[0] / tot[1]).item():.4f}  val ppl {ppl:.3f}  recovery {rec:.4f}",
                  flush=True)
            if run is not None:
                run.log({"train/loss": (tot[0] / tot[1]).item(), "val/ppl": ppl, "val/recovery": rec}, step=epoch)
            os.makedirs(os.path.dirname(args.ckpt), exist_ok=True)
            torch.save({"model": model.module.state_dict(), "optimizer": optimizer.state_dict(), "epoch": epoch},
                       args.ckpt)
        dist.barrier()

    if run is not None:
        run.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    args = parse_args()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", args.port)
    mp.spawn(train_worker, args=(args.gpus, args), nprocs=args.gpus, join=True)
