#!/usr/bin/env python
# RoBERTa-style masked LM pretraining from pre-tokenized shards (one .npy of uint16 ids per shard).
#
#   # on each of the 4 nodes:
#   torchrun --nnodes=4 --nproc_per_node=8 --node_rank=$NODE_RANK --master_addr=$MASTER --master_port=29500 \
#       09_mlm_pretrain_shards.py --data-dir /data/cc_tok --vocab-size 32000 --max-updates 125000
import argparse
import glob
import math
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, IterableDataset, Subset
from torch.utils.tensorboard import SummaryWriter

PAD_ID, CLS_ID, SEP_ID, MASK_ID = 0, 1, 2, 3


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data-dir", required=True)
    p.add_argument("--vocab-size", type=int, default=32000)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--batch-size", type=int, default=32, help="sequences per GPU per micro-batch")
    p.add_argument("--max-updates", type=int, default=125000)
    p.add_argument("--warmup", type=int, default=10000)
    p.add_argument("--lr", type=float, default=6e-4)
    p.add_argument("--mask-prob", type=float, default=0.15)
    p.add_argument("--valid-every", type=int, default=2000)
    p.add_argument("--save-dir", default="ckpt/mlm_base")
    p.add_argument("--seed", type=int, default=1)
    return p.parse_args()


class ShardStream(IterableDataset):
    """Endless stream of fixed-length blocks from this rank's shard files."""

    def __init__(self, files, seq_len, seed):
        self.files, self.seq_len, self.seed = files, seq_len, seed

    def __iter__(self):
        rng = np.random.default_rng(self.seed)
        n = self.seq_len - 2
        while True:
            for f in rng.permutation(self.files):
                ids = np.load(f, mmap_mode="r")
                nblk = len(ids) // n
                for b in rng.permutation(nblk):
                    blk = np.asarray(ids[b * n:(b + 1) * n], dtype=np.int64)
                    yield torch.from_numpy(np.concatenate([[CLS_ID], blk, [SEP_ID]]))


class ValidBlocks(torch.utils.data.Dataset):
    def __init__(self, path, seq_len):
        ids = np.load(path)
        n = seq_len - 2
        self.blocks = [np.concatenate([[CLS_ID], ids[i:i + n], [SEP_ID]]).astype(np.int64)
                       for i in range(0, len(ids) - n + 1, n)]

    def __len__(self):
        return len(self.blocks)

    def __getitem__(self, i):
        return torch.from_numpy(self.blocks[i])


def mask_tokens(x, vocab_size, prob, gen=None):
    labels = x.clone()
    special = (x == CLS_ID) | (x == SEP_ID) | (x == PAD_ID)
    probs = torch.full(x.shape, prob, device=x.device).masked_fill(special, 0.0)
    m = torch.bernoulli(probs, generator=gen).bool()
    labels[~m] = -100
    x = x.clone()
    r = torch.rand(x.shape, device=x.device, generator=gen)
    x[m & (r < 0.8)] = MASK_ID
    rnd = m & (r >= 0.8) & (r < 0.9)
    x[rnd] = torch.randint(4, vocab_size, (int(rnd.sum()),), device=x.device, generator=gen)
    return x, labels


class Encoder(nn.Module):
    def __init__(self, vocab, d=768, layers=12, heads=12, max_len=512):
        super().__init__()
        self.tok = nn.Embedding(vocab, d, padding_idx=PAD_ID)
        self.pos = nn.Embedding(max_len, d)
        self.emb_ln = nn.LayerNorm(d)
        layer = nn.TransformerEncoderLayer(d, heads, 4 * d, 0.1, activation="gelu", batch_first=True)
        self.layers = nn.TransformerEncoder(layer, layers)
        self.lm_dense = nn.Linear(d, d)
        self.lm_ln = nn.LayerNorm(d)
        self.lm_bias = nn.Parameter(torch.zeros(vocab))

    def forward(self, x):
        h = self.tok(x) + self.pos(torch.arange(x.size(1), device=x.device))
        h = self.layers(self.emb_ln(h), src_key_padding_mask=x.eq(PAD_ID))
        h = self.lm_ln(F.gelu(self.lm_dense(h)))
        return F.linear(h, self.tok.weight, self.lm_bias)


def lr_at(step, args):
    if step < args.warmup:
        return args.lr * step / args.warmup
    return args.lr * max(0.0, (args.max_updates - step) / (args.max_updates - args.warmup))


@torch.no_grad()
def validate(model, loader, args, device):
    model.eval()
    g = torch.Generator(device=device)
    g.manual_seed(1234)  # same masks every validation
    tot = torch.zeros(2, device=device, dtype=torch.float64)
    for x in loader:
        x = x.to(device)
        inp, lab = mask_tokens(x, args.vocab_size, args.mask_prob, g)
        with torch.autocast("cuda", dtype=torch.float16):
            logits = model(inp)
        tot[0] += F.cross_entropy(logits.float().view(-1, logits.size(-1)), lab.view(-1),
                                  ignore_index=-100, reduction="sum").double()
        tot[1] += (lab != -100).sum()
    dist.all_reduce(tot)
    model.train()
    return (tot[0] / tot[1]).item()


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    files = sorted(glob.glob(os.path.join(args.data_dir, "train", "shard_*.npy")))
    assert len(files) >= world, f"need at least {world} shards, found {len(files)}"
    stream = ShardStream(files[rank::world], args.seq_len, seed=args.seed * 1000 + rank)
    train_dl = DataLoader(stream, batch_size=args.batch_size, num_workers=1, pin_memory=True)
    valid = ValidBlocks(os.path.join(args.data_dir, "valid.npy"), args.seq_len)
    valid_dl = DataLoader(Subset(valid, range(rank, len(valid), world)), batch_size=args.batch_size)

    torch.manual_seed(args.seed)
    model = Encoder(args.vocab_size, max_len=args.seq_len).to(device)
    no_decay = ("bias", "ln", "lm_bias")
    groups = [
        {"params": [p for n, p in model.named_parameters() if not any(k in n for k in no_decay)], "weight_decay": 0.01},
        {"params": [p for n, p in model.named_parameters() if any(k in n for k in no_decay)], "weight_decay": 0.0},
    ]
    opt = torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, 0.98), eps=1e-6)
    scaler = torch.cuda.amp.GradScaler()
    step = 0

    ckpt_file = os.path.join(args.save_dir, "checkpoint_last.pt")
    if os.path.exists(ckpt_file):
        state = torch.load(ckpt_file, map_location="cpu")
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        scaler.load_state_dict(state["scaler"])
        step = state["step"]
        del state
    model = DDP(model, device_ids=[local_rank])

    writer = SummaryWriter(os.path.join(args.save_dir, "tb")) if rank == 0 else None
    mask_gen = torch.Generator(device=device)
    mask_gen.manual_seed(args.seed + 17 * rank)

    t0 = time.time()
    data_iter = iter(train_dl)
    while step < args.max_updates:
        x = next(data_iter).to(device, non_blocking=True)
        inp, lab = mask_tokens(x, args.vocab_size, args.mask_prob, mask_gen)
        for g in opt.param_groups:
            g["lr"] = lr_at(step, args)
        with torch.autocast("cuda", dtype=torch.float16):
            logits = model(inp)
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)).float(), lab.view(-1), ignore_index=-100)
        opt.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        gnorm = nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(opt)
        scaler.update()
        step += 1

        if writer is not None and step % 100 == 0:
            el = time.time() - t0
            t0 = time.time()
            writer.add_scalar("train/loss", loss.item() / math.log(2), step)
            writer.add_scalar("train/gnorm", gnorm.item(), step)
            writer.add_scalar("train/lr", opt.param_groups[0]["lr"], step)
            writer.add_scalar("train/ups", 100 / el, step)

        if step % args.valid_every == 0 or step == args.max_updates:
            vloss = validate(model.module, valid_dl, args, device)
            if rank == 0:
                print(f"| step {step} | valid loss {vloss / math.log(2):.3f} | ppl {math.exp(vloss):.2f}", flush=True)
                writer.add_scalar("valid/loss", vloss / math.log(2), step)
                os.makedirs(args.save_dir, exist_ok=True)
                torch.save({"model": model.module.state_dict(), "optimizer": opt.state_dict(),
                            "scaler": scaler.state_dict(), "step": step}, ckpt_file + ".tmp")
                os.replace(ckpt_file + ".tmp", ckpt_file)
            dist.barrier()

    if writer is not None:
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
