#!/usr/bin/env python
"""Masked-language-model pretraining of a small protein transformer on UniRef50.

Usage (4 nodes x 4 GPUs):

    sbatch --nodes=4 --ntasks-per-node=4 --gres=gpu:4 --cpus-per-task=8 \
           --time=48:00:00 --wrap="srun python protein_mlm.py --config cfg/esm_small.yaml"
"""
import argparse
import math
import os
import random
import socket
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import yaml
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

AA = "ACDEFGHIKLMNPQRSTVWYXBUZO"
PAD, CLS, EOS, MASK = 0, 1, 2, 3
VOCAB = {a: i + 4 for i, a in enumerate(AA)}
VOCAB_SIZE = len(VOCAB) + 4


class FastaWindows(Dataset):
    def __init__(self, index_file, max_len):
        # index file: one sequence per line, already filtered to <= 4k residues
        with open(index_file) as f:
            self.seqs = [l.strip() for l in f if l.strip()]
        self.max_len = max_len

    def __len__(self):
        return len(self.seqs)

    def __getitem__(self, i):
        s = self.seqs[i]
        if len(s) > self.max_len - 2:
            start = random.randint(0, len(s) - (self.max_len - 2))
            s = s[start:start + self.max_len - 2]
        return torch.tensor([CLS] + [VOCAB.get(c, VOCAB["X"]) for c in s] + [EOS])


def collate_mlm(batch, mask_prob=0.15):
    L = max(len(b) for b in batch)
    ids = torch.full((len(batch), L), PAD, dtype=torch.long)
    for i, b in enumerate(batch):
        ids[i, :len(b)] = b
    labels = ids.clone()
    special = ids < 4
    prob = torch.full(ids.shape, mask_prob).masked_fill(special, 0.0)
    chosen = torch.bernoulli(prob).bool()
    labels[~chosen] = -100
    r = torch.rand(ids.shape)
    ids[chosen & (r < 0.8)] = MASK
    rand_tok = chosen & (r >= 0.8) & (r < 0.9)
    ids[rand_tok] = torch.randint(4, VOCAB_SIZE, (int(rand_tok.sum()),))
    return ids, labels


class ProteinLM(nn.Module):
    def __init__(self, dim=640, layers=30, heads=20, max_len=1024):
        super().__init__()
        self.tok = nn.Embedding(VOCAB_SIZE, dim, padding_idx=PAD)
        self.pos = nn.Embedding(max_len, dim)
        enc_layer = nn.TransformerEncoderLayer(dim, heads, 4 * dim, dropout=0.0,
                                               activation="gelu", batch_first=True, norm_first=True)
        self.encoder = nn.TransformerEncoder(enc_layer, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(dim)
        self.lm_head = nn.Linear(dim, VOCAB_SIZE)

    def forward(self, ids):
        pos = torch.arange(ids.shape[1], device=ids.device)
        h = self.tok(ids) + self.pos(pos)[None]
        h = self.encoder(h, src_key_padding_mask=ids.eq(PAD))
        return self.lm_head(self.norm(h))


def init_distributed():
    rank = int(os.environ["SLURM_PROCID"])
    world_size = int(os.environ["SLURM_NTASKS"])
    local_rank = int(os.environ["SLURM_LOCALID"])
    os.environ["MASTER_ADDR"] = os.environ.get("SLURMD_NODENAME", socket.gethostname())
    os.environ.setdefault("MASTER_PORT", "29512")
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl", rank=rank, world_size=world_size)
    return rank, world_size, local_rank


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", required=True)
    cfg = yaml.safe_load(open(ap.parse_args().config))

    rank, world, local_rank = init_distributed()
    torch.manual_seed(cfg["seed"])
    random.seed(cfg["seed"] + rank)

    train = FastaWindows(cfg["train_index"], cfg["max_len"])
    valid = FastaWindows(cfg["valid_index"], cfg["max_len"])
    tr_sampler = DistributedSampler(train, shuffle=True, seed=cfg["seed"])
    va_sampler = DistributedSampler(valid, shuffle=False, drop_last=True)
    nw = int(os.environ.get("SLURM_CPUS_PER_TASK", 4))
    tr_dl = DataLoader(train, cfg["batch_per_gpu"], sampler=tr_sampler, collate_fn=collate_mlm,
                       num_workers=nw, pin_memory=True, drop_last=True)
    va_dl = DataLoader(valid, cfg["batch_per_gpu"], sampler=va_sampler, collate_fn=collate_mlm,
                       num_workers=nw)

    model = ProteinLM(cfg["dim"], cfg["layers"], cfg["heads"], cfg["max_len"]).cuda()
    model = DDP(model, device_ids=[local_rank])
    peak_lr = cfg["lr"]  # tuned for the global batch in the config (4096 seqs)
    assert cfg["batch_per_gpu"] * world == cfg["global_batch"], "adjust batch_per_gpu"
    opt = torch.optim.AdamW(model.parameters(), lr=peak_lr, betas=(0.9, 0.98), eps=1e-6,
                            weight_decay=0.01)
    warm, total = cfg["warmup_steps"], cfg["max_steps"]
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min((s + 1) / warm, max(0.0, (total - s) / (total - warm))))

    out = cfg["out_dir"]
    ckpt = os.path.join(out, "latest.pt")
    step = 0
    if os.path.isfile(ckpt):
        st = torch.load(ckpt, map_location="cpu")
        model.module.load_state_dict(st["model"])
        opt.load_state_dict(st["opt"])
        sched.load_state_dict(st["sched"])
        step = st["step"]
    if rank == 0:
        os.makedirs(out, exist_ok=True)

    epoch = step // len(tr_dl)
    model.train()
    t0 = time.time()
    while step < total:
        tr_sampler.set_epoch(epoch)
        for ids, labels in tr_dl:
            ids, labels = ids.cuda(non_blocking=True), labels.cuda(non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = model(ids)
            loss = F.cross_entropy(logits.float().view(-1, VOCAB_SIZE), labels.view(-1),
                                   ignore_index=-100)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            step += 1

            if step % 100 == 0 and rank == 0:
                print(f"step {step} loss {loss.item():.3f} ppl {math.exp(loss.item()):.2f} "
                      f"{(time.time() - t0) / 100:.3f}s/step", flush=True)
                t0 = time.time()

            if step % cfg["eval_every"] == 0:
                model.eval()
                acc = torch.zeros(2, device="cuda")
                with torch.no_grad():
                    for vids, vlab in va_dl:
                        vids, vlab = vids.cuda(), vlab.cuda()
                        with torch.autocast("cuda", dtype=torch.bfloat16):
                            vlog = model.module(vids).float()
                        m = vlab != -100
                        acc[0] += F.cross_entropy(vlog[m], vlab[m], reduction="sum")
                        acc[1] += m.sum()
                dist.all_reduce(acc)
                if rank == 0:
                    print(f"step {step} valid ppl {math.exp((acc[0] / acc[1]).item()):.3f}",
                          flush=True)
                    torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(),
                                "sched": sched.state_dict(), "step": step}, ckpt)
                dist.barrier()
                model.train()
            if step >= total:
                break
        epoch += 1

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
