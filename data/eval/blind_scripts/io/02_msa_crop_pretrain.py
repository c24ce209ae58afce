"""Masked-MSA pretraining of a small axial-attention model on cropped alignments.

Each example is an a3m alignment: insertions (lower case) are removed, up to
--max_seqs rows are sampled (the query row is always kept) and a random window
of --crop_len columns is taken, as in AlphaFold-style cropping.

Launch:
    torchrun --nnodes=2 --nproc_per_node=8 --rdzv_backend=c10d \
        --rdzv_endpoint=$HEAD:29500 02_msa_crop_pretrain.py --config cfg/msa_small.yaml
"""
import argparse
import math
import os
import string
from dataclasses import dataclass, asdict

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import yaml
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler

AA = "ARNDCQEGHILKMFPSTWYV-"
PAD, MASK, UNK = 21, 22, 23
VOCAB = 24
_DELETE_LOWER = str.maketrans("", "", string.ascii_lowercase + ".")
_AA_IDX = {a: i for i, a in enumerate(AA)}


@dataclass
class Config:
    train_list: str = "data/msa/train.txt"
    val_list: str = "data/msa/val.txt"
    a3m_dir: str = "data/msa/a3m"
    out_dir: str = "/shared/runs/msa_small"
    max_seqs: int = 128
    crop_len: int = 256
    dim: int = 256
    heads: int = 8
    layers: int = 8
    batch_size: int = 2
    accum_steps: int = 4
    lr: float = 3e-4
    warmup: int = 2000
    max_steps: int = 100_000
    eval_every: int = 2000
    mask_prob: float = 0.15
    num_workers: int = 6
    seed: int = 0
    resume: str = ""


def read_a3m(path):
    seqs = []
    with open(path) as f:
        for line in f:
            line = line.strip()
            if not line or line.startswith(">"):
                continue
            seqs.append(line.translate(_DELETE_LOWER))
    return seqs


class MSADataset(Dataset):
    def __init__(self, list_file, a3m_dir, max_seqs, crop_len, train=True):
        with open(list_file) as f:
            self.names = [l.strip() for l in f if l.strip()]
        self.a3m_dir, self.max_seqs, self.crop_len, self.train = a3m_dir, max_seqs, crop_len, train
        self.rng = np.random.default_rng()

    def __len__(self):
        return len(self.names)

    def __getitem__(self, i):
        seqs = read_a3m(os.path.join(self.a3m_dir, self.names[i] + ".a3m"))
        msa = np.array([[_AA_IDX.get(c, UNK) for c in s] for s in seqs], dtype=np.int64)
        n, L = msa.shape
        if n > self.max_seqs:
            if self.train:
                rows = self.rng.choice(np.arange(1, n), self.max_seqs - 1, replace=False)
            else:
                rows = np.arange(1, self.max_seqs)
            msa = msa[np.concatenate([[0], np.sort(rows)])]
        if L > self.crop_len:
            start = self.rng.integers(0, L - self.crop_len + 1) if self.train else 0
            msa = msa[:, start:start + self.crop_len]
        return torch.from_numpy(msa)


def worker_init_fn(worker_id):
    # augmentation streams differ per rank and per worker; the data split does not depend on them
    info = torch.utils.data.get_worker_info()
    rank = dist.get_rank() if dist.is_initialized() else 0
    info.dataset.rng = np.random.default_rng([info.seed % 2**32, rank, worker_id])


def make_collate(mask_prob):
    def collate(batch):
        N = max(m.shape[0] for m in batch)
        L = max(m.shape[1] for m in batch)
        tokens = torch.full((len(batch), N, L), PAD, dtype=torch.long)
        for b, m in enumerate(batch):
            tokens[b, :m.shape[0], :m.shape[1]] = m
        targets = tokens.clone()
        maskable = tokens != PAD
        masked = (torch.rand(tokens.shape) < mask_prob) & maskable
        tokens[masked] = MASK
        targets[~masked] = -100
        return tokens, targets
    return collate


class AxialBlock(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.row_norm = nn.LayerNorm(dim)
        self.row_attn = nn.MultiheadAttention(dim, heads, batch_first=True)
        self.col_norm = nn.LayerNorm(dim)
        self.col_attn = nn.MultiheadAttention(dim, heads, batch_first=True)
        self.ff = nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x, pad):
        B, N, L, D = x.shape
        h = self.row_norm(x).reshape(B * N, L, D)
        kpm = pad.reshape(B * N, L).clone()
        kpm[:, 0] = False  # fully padded rows would give NaN softmax
        x = x + self.row_attn(h, h, h, key_padding_mask=kpm, need_weights=False)[0].reshape(B, N, L, D)
        h = self.col_norm(x).transpose(1, 2).reshape(B * L, N, D)
        kpm = pad.transpose(1, 2).reshape(B * L, N).clone()
        kpm[:, 0] = False
        out = self.col_attn(h, h, h, key_padding_mask=kpm, need_weights=False)[0]
        x = x + out.reshape(B, L, N, D).transpose(1, 2)
        return x + self.ff(x)


class MSAModel(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, cfg.dim, padding_idx=PAD)
        self.pos = nn.Embedding(1024, cfg.dim)
        self.row_pos = nn.Embedding(cfg.max_seqs, cfg.dim)
        self.blocks = nn.ModuleList([AxialBlock(cfg.dim, cfg.heads) for _ in range(cfg.layers)])
        self.norm = nn.LayerNorm(cfg.dim)
        self.head = nn.Linear(cfg.dim, VOCAB)

    def forward(self, tokens):
        B, N, L = tokens.shape
        pad = tokens == PAD
        cols = torch.arange(L, device=tokens.device)
        rows = torch.arange(N, device=tokens.device)
        x = self.embed(tokens) + self.pos(cols)[None, None] + self.row_pos(rows)[None, :, None]
        for blk in self.blocks:
            x = blk(x, pad)
        return self.head(self.norm(x))


def all_gather_variable(t, world_size):
    """all_gather for 1-D tensors whose length differs between ranks."""
    n = torch.tensor([t.numel()], device=t.device)
    sizes = [torch.zeros_like(n) for _ in range(world_size)]
    dist.all_gather(sizes, n)
    max_n = int(max(s.item() for s in sizes))
    padded = torch.zeros(max_n, dtype=t.dtype, device=t.device)
    padded[:t.numel()] = t
    out = [torch.zeros_like(padded) for _ in range(world_size)]
    dist.all_gather(out, padded)
    return torch.cat([o[:int(s.item())] for o, s in zip(out, sizes)])


@torch.no_grad()
def evaluate(model, loader, device, world_size):
    model.eval()
    totals = torch.zeros(3, device=device, dtype=torch.float64)  # nll, correct, tokens
    per_msa = []
    for tokens, targets in loader:
        tokens, targets = tokens.to(device), targets.to(device)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(tokens).float()
        nll = F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1),
                              ignore_index=-100, reduction="none").reshape(targets.shape)
        valid = targets != -100
        totals[0] += nll.sum()
        totals[1] += ((logits.argmax(-1) == targets) & valid).sum()
        totals[2] += valid.sum()
        per_msa.append(nll.sum(dim=(1, 2)) / valid.sum(dim=(1, 2)).clamp(min=1))
    dist.all_reduce(totals)
    local = torch.cat(per_msa) if per_msa else torch.zeros(0, device=device)
    all_ppl = torch.exp(all_gather_variable(local, world_size))
    model.train()
    return {"ppl": math.exp(totals[0].item() / totals[2].item()),
            "acc": totals[1].item() / totals[2].item(),
            "median_msa_ppl": all_ppl.median().item()}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default=None)
    cli = ap.parse_args()
    cfg = Config()
    if cli.config:
        with open(cli.config) as f:
            for k, v in yaml.safe_load(f).items():
                setattr(cfg, k, v)

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{local_rank}")
    torch.manual_seed(cfg.seed)

    model = MSAModel(cfg)
    start_step = 0
    if cfg.resume:
        ckpt = torch.load(cfg.resume, map_location="cpu")
        model.load_state_dict(ckpt["model"])
        start_step = ckpt["step"]
    model = DDP(model.to(device), device_ids=[local_rank])
    optim = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(0.9, 0.98), weight_decay=0.01)
    if cfg.resume:
        optim.load_state_dict(ckpt["optim"])
    sched = torch.optim.lr_scheduler.LambdaLR(
        optim, lambda s: min((s + 1) / cfg.warmup, math.sqrt(cfg.warmup / max(s + 1, 1))),
        last_epoch=start_step - 1)

    train_set = MSADataset(cfg.train_list, cfg.a3m_dir, cfg.max_seqs, cfg.crop_len, train=True)
    val_set = MSADataset(cfg.val_list, cfg.a3m_dir, cfg.max_seqs, cfg.crop_len, train=False)
    sampler = DistributedSampler(train_set, shuffle=True, seed=cfg.seed, drop_last=True)
    collate = make_collate(cfg.mask_prob)
    train_loader = DataLoader(train_set, batch_size=cfg.batch_size, sampler=sampler,
                              num_workers=cfg.num_workers, collate_fn=collate,
                              worker_init_fn=worker_init_fn, pin_memory=True, drop_last=True)
    # validation: each rank takes every world-th MSA, no padding duplicates
    val_shard = Subset(val_set, list(range(rank, len(val_set), world)))
    val_loader = DataLoader(val_shard, batch_size=cfg.batch_size, num_workers=2, collate_fn=collate)

    if rank == 0:
        os.makedirs(cfg.out_dir, exist_ok=True)
        with open(os.path.join(cfg.out_dir, "config.yaml"), "w") as f:
            yaml.safe_dump(asdict(cfg), f)

    step, epoch, micro = start_step, start_step // max(1, len(train_loader) // cfg.accum_steps), 0
    model.train()
    while step < cfg.max_steps:
        sampler.set_epoch(epoch)
        for tokens, targets in train_loader:
            tokens = tokens.to(device, non_blocking=True)
            targets = targets.to(device, non_blocking=True)
            micro += 1
            sync = micro % cfg.accum_steps == 0
            with (model.no_sync() if not sync else torch.enable_grad()):
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    logits = model(tokens)
                loss = F.cross_entropy(logits.float().reshape(-1, VOCAB), targets.reshape(-1),
                                       ignore_index=-100) / cfg.accum_steps
                loss.backward()
            if not sync:
                continue
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optim.step()
            sched.step()
            optim.zero_grad(set_to_none=True)
            step += 1
            if rank == 0 and step % 100 == 0:
                print(f"step {step} loss {loss.item() * cfg.accum_steps:.3f} lr {sched.get_last_lr()[0]:.2e}",
                      flush=True)
            if step % cfg.eval_every == 0:
                # eval through the unwrapped module: shards differ in size across ranks
                metrics = evaluate(model.module, val_loader, device, world)
                if rank == 0:
                    print(f"step {step} val {metrics}", flush=True)
                    torch.save({"model": model.module.state_dict(), "optim": optim.state_dict(),
                                "step": step, "cfg": asdict(cfg)},
                               os.path.join(cfg.out_dir, f"step_{step:07d}.pt"))
                dist.barrier()
            if step >= cfg.max_steps:
                break
        epoch += 1

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
