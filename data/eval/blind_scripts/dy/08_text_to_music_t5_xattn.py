"""Text-to-music LM (MusicGen-style): frozen T5 text encoder, cross-attention decoder
over delayed EnCodec codebooks, classifier-free guidance dropout on the text.

    torchrun --nproc_per_node=8 08_text_to_music_t5_xattn.py --train meta/train.jsonl \
        --valid meta/valid.jsonl --run-name t2m-medium-v3
"""
import argparse
import json
import math
import os
import random
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import wandb
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoTokenizer, T5EncoderModel


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--train", required=True)
    p.add_argument("--valid", required=True)
    p.add_argument("--run-name", default="t2m")
    p.add_argument("--ckpt-dir", default="/mnt/shared/ckpt/t2m")
    p.add_argument("--t5", default="t5-base")
    p.add_argument("--frames", type=int, default=1500)
    p.add_argument("--n-q", type=int, default=4)
    p.add_argument("--card", type=int, default=2048)
    p.add_argument("--dim", type=int, default=1024)
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--batch-size", type=int, default=192, help="global")
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--warmup", type=int, default=4000)
    p.add_argument("--max-steps", type=int, default=500_000)
    p.add_argument("--cfg-dropout", type=float, default=0.1)
    p.add_argument("--seed", type=int, default=2024)
    return p.parse_args()


class DescribedCodes(Dataset):
    def __init__(self, jsonl, frames, train=True):
        with open(jsonl) as f:
            self.items = [json.loads(l) for l in f]
        self.frames, self.train = frames, train

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        it = self.items[i]
        codes = np.load(it["codes"], mmap_mode="r")
        t = codes.shape[-1]
        s = random.randint(0, max(0, t - self.frames)) if self.train else 0
        c = torch.from_numpy(np.array(codes[:, s : s + self.frames], dtype=np.int64))
        if c.shape[-1] < self.frames:
            c = F.pad(c, (0, self.frames - c.shape[-1]), value=-100)
        return c, it["description"]


def collate(batch):
    codes, texts = zip(*batch)
    return torch.stack(codes), list(texts)


class T2MDecoder(nn.Module):
    def __init__(self, n_q, card, dim, layers, text_dim, max_len):
        super().__init__()
        self.n_q, self.card = n_q, card
        self.emb = nn.ModuleList(nn.Embedding(card + 1, dim) for _ in range(n_q))
        self.pos = nn.Embedding(max_len, dim)
        self.text_proj = nn.Linear(text_dim, dim)
        layer = nn.TransformerDecoderLayer(dim, dim // 64, 4 * dim, 0.1, "gelu", batch_first=True, norm_first=True)
        self.decoder = nn.TransformerDecoder(layer, layers)
        self.ln = nn.LayerNorm(dim)
        self.heads = nn.ModuleList(nn.Linear(dim, card) for _ in range(n_q))

    def forward(self, tokens, text_states, text_pad):
        t = tokens.shape[-1]
        x = sum(self.emb[k](tokens[:, k]) for k in range(self.n_q)) + self.pos.weight[:t]
        mem = self.text_proj(text_states)
        causal = torch.triu(torch.ones(t, t, dtype=torch.bool, device=x.device), 1)
        h = self.decoder(x, mem, tgt_mask=causal, memory_key_padding_mask=text_pad)
        h = self.ln(h)
        return torch.stack([head(h) for head in self.heads], 1)


def delayed_io(codes, card):
    b, k, t = codes.shape
    special = card
    d = codes.new_full((b, k, t + k), special)
    for q in range(k):
        d[:, q, q + 1 : q + 1 + t] = codes[:, q]
    inp, tgt = d[..., :-1].clone(), d[..., 1:].clone()
    inp[inp < 0] = special
    tgt[tgt == special] = -100
    return inp, tgt


class TextConditioner:
    def __init__(self, name, device):
        self.tok = AutoTokenizer.from_pretrained(name)
        self.enc = T5EncoderModel.from_pretrained(name).to(device).eval().requires_grad_(False)
        self.device = device

    @torch.no_grad()
    def __call__(self, texts):
        b = self.tok(texts, return_tensors="pt", padding=True, truncation=True, max_length=128).to(self.device)
        states = self.enc(**b).last_hidden_state
        return states, b["attention_mask"] == 0


def lr_at(step, args):
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    return args.lr * 0.5 * (1 + math.cos(math.pi * min(1.0, (step - args.warmup) / (args.max_steps - args.warmup))))


@torch.no_grad()
def evaluate(net, loader, cond, args, device):
    net.eval()
    acc = torch.zeros(2, device=device)
    for codes, texts in loader:
        codes = codes.to(device)
        inp, tgt = delayed_io(codes, args.card)
        states, pad = cond(texts)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = net(inp, states, pad)
        acc[0] += F.cross_entropy(logits.float().flatten(0, 2), tgt.flatten(), reduction="sum")
        acc[1] += (tgt != -100).sum()
    dist.all_reduce(acc)
    net.train()
    return (acc[0] / acc[1]).item()


def main():
    args = get_args()
    wandb.init(project="text2music", name=args.run_name, config=vars(args))

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    random.seed(args.seed + rank)
    torch.manual_seed(args.seed + rank)

    cond = TextConditioner(args.t5, device)
    train_ds = DescribedCodes(args.train, args.frames)
    valid_ds = DescribedCodes(args.valid, args.frames, train=False)
    sampler = DistributedSampler(train_ds, shuffle=True, seed=args.seed, drop_last=True)
    per_gpu = args.batch_size // world
    train_dl = DataLoader(train_ds, per_gpu, sampler=sampler, collate_fn=collate, num_workers=8,
                          pin_memory=True, drop_last=True, persistent_workers=True)
    valid_dl = DataLoader(Subset(valid_ds, range(rank, len(valid_ds), world)), per_gpu,
                          collate_fn=collate, num_workers=2)

    net = T2MDecoder(args.n_q, args.card, args.dim, args.layers, cond.enc.config.d_model,
                     args.frames + args.n_q + 1).to(device)
    model = DDP(net, device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)

    step, epoch = 0, 0
    last = os.path.join(args.ckpt_dir, "last.pt")
    if os.path.exists(last):
        st = torch.load(last, map_location="cpu")
        net.load_state_dict(st["model"])
        opt.load_state_dict(st["opt"])
        step, epoch = st["step"], st["epoch"]

    tic = time.time()
    while step < args.max_steps:
        sampler.set_epoch(epoch)
        for codes, texts in train_dl:
            texts = ["" if random.random() < args.cfg_dropout else t for t in texts]
            codes = codes.to(device, non_blocking=True)
            inp, tgt = delayed_io(codes, args.card)
            states, pad = cond(texts)
            for g in opt.param_groups:
                g["lr"] = lr_at(step, args)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = model(inp, states, pad)
            loss = F.cross_entropy(logits.float().flatten(0, 2), tgt.flatten())
            opt.zero_grad(set_to_none=True)
            loss.backward()
            gn = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            step += 1

            if step % 100 == 0:
                rep = torch.stack([loss.detach(), gn.detach()])
                dist.all_reduce(rep, op=dist.ReduceOp.AVG)
                if rank == 0:
                    wandb.log({"train/loss": rep[0].item(), "train/grad_norm": rep[1].item(),
                               "train/lr": opt.param_groups[0]["lr"],
                               "train/steps_per_s": 100 / (time.time() - tic)}, step=step)
                tic = time.time()

            if step % 5000 == 0:
                vloss = evaluate(net, valid_dl, cond, args, device)
                if rank == 0:
                    wandb.log({"valid/loss": vloss, "valid/ppl": math.exp(vloss)}, step=step)
                    os.makedirs(args.ckpt_dir, exist_ok=True)
                    torch.save({"model": net.state_dict(), "opt": opt.state_dict(), "step": step,
                                "epoch": epoch, "args": vars(args)}, last + ".tmp")
                    os.replace(last + ".tmp", last)
                dist.barrier()
            if step >= args.max_steps:
                break
        epoch += 1

    if rank == 0:
        wandb.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
