"""ELECTRA-small replaced-token-detection pretraining (generator + discriminator).

Sequences are pre-packed to 128 tokens (int32 .npy, [N, 128]) with the BERT uncased vocab.

    torchrun --nproc_per_node=4 06_electra_rtd.py --train /data/owt_128/train.npy \
        --valid /data/owt_128/valid.npy --out runs/electra-small
"""
import argparse
import math
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

VOCAB, PAD, CLS, SEP, MASK = 30522, 0, 101, 102, 103


class Encoder(nn.Module):
    def __init__(self, hidden, layers, heads, ffn, emb_dim, max_len=512):
        super().__init__()
        self.word = nn.Embedding(VOCAB, emb_dim, padding_idx=PAD)
        self.pos = nn.Embedding(max_len, emb_dim)
        self.emb_ln = nn.LayerNorm(emb_dim)
        self.emb_proj = nn.Linear(emb_dim, hidden) if emb_dim != hidden else nn.Identity()
        layer = nn.TransformerEncoderLayer(hidden, heads, ffn, dropout=0.1, activation="gelu",
                                           batch_first=True, norm_first=False)
        self.layers = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.pooler = nn.Sequential(nn.Linear(hidden, hidden), nn.Tanh())

    def forward(self, ids, return_pooled=False):
        pos = torch.arange(ids.size(1), device=ids.device)
        x = self.emb_proj(self.emb_ln(self.word(ids) + self.pos(pos)))
        h = self.layers(x, src_key_padding_mask=(ids == PAD))
        if return_pooled:
            return h, self.pooler(h[:, 0])
        return h


class Electra(nn.Module):
    def __init__(self, emb_dim=128, disc_hidden=256, gen_hidden=64):
        super().__init__()
        self.generator = Encoder(gen_hidden, 12, 1, 256, emb_dim)
        self.discriminator = Encoder(disc_hidden, 12, 4, 1024, emb_dim)
        # generator and discriminator share token/position embeddings
        self.generator.word = self.discriminator.word
        self.generator.pos = self.discriminator.pos
        self.gen_head = nn.Sequential(nn.Linear(gen_hidden, emb_dim), nn.GELU(), nn.LayerNorm(emb_dim))
        self.gen_bias = nn.Parameter(torch.zeros(VOCAB))
        self.disc_head = nn.Sequential(nn.Linear(disc_hidden, disc_hidden), nn.GELU(),
                                       nn.Linear(disc_hidden, 1))

    def forward(self, masked_ids, labels, orig_ids, temperature=1.0):
        gen_h = self.generator(masked_ids)
        is_masked = labels != -100
        gen_logits = self.gen_head(gen_h[is_masked]) @ self.discriminator.word.weight.t() + self.gen_bias
        gen_loss = F.cross_entropy(gen_logits.float(), labels[is_masked])

        with torch.no_grad():
            gumbel = -torch.log(-torch.log(torch.rand_like(gen_logits, dtype=torch.float32) + 1e-9) + 1e-9)
            sampled = (gen_logits.float() / temperature + gumbel).argmax(-1)
            corrupted = masked_ids.clone()
            corrupted[is_masked] = sampled
            rtd_labels = (corrupted != orig_ids).float()

        disc_h = self.discriminator(corrupted)
        disc_logits = self.disc_head(disc_h).squeeze(-1)
        non_pad = orig_ids != PAD
        disc_loss = F.binary_cross_entropy_with_logits(disc_logits[non_pad], rtd_labels[non_pad])
        acc = ((disc_logits[non_pad] > 0).float() == rtd_labels[non_pad]).float().mean()
        return gen_loss, disc_loss, acc


class Packed(Dataset):
    def __init__(self, path):
        self.ids = np.load(path, mmap_mode="r")

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return torch.from_numpy(self.ids[i].astype(np.int64))


def mask_tokens(ids, p=0.15):
    labels = ids.clone()
    special = (ids == PAD) | (ids == CLS) | (ids == SEP)
    m = torch.bernoulli(torch.full(ids.shape, p, device=ids.device)).bool() & ~special
    labels[~m] = -100
    masked = ids.clone()
    r = torch.rand(ids.shape, device=ids.device)
    masked[m & (r < 0.85)] = MASK
    rnd = m & (r >= 0.85) & (r < 0.925)
    masked[rnd] = torch.randint(1000, VOCAB, (int(rnd.sum()),), device=ids.device)
    return masked, labels


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--train", required=True)
    ap.add_argument("--valid", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--lr", type=float, default=5e-4)
    ap.add_argument("--warmup", type=int, default=10000)
    ap.add_argument("--steps", type=int, default=1000000)
    ap.add_argument("--disc_weight", type=float, default=50.0)
    ap.add_argument("--save_every", type=int, default=25000)
    args = ap.parse_args()

    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dev = torch.device("cuda", local_rank)
    torch.manual_seed(0)

    model = Electra().to(dev)
    model = DDP(model, device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01, eps=1e-6)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min((s + 1) / args.warmup, max(0.0, 1 - s / args.steps)))

    train_ds, valid_ds = Packed(args.train), Packed(args.valid)
    sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    loader = DataLoader(train_ds, batch_size=args.batch, sampler=sampler, num_workers=4,
                        pin_memory=True, drop_last=True)
    vloader = DataLoader(valid_ds, batch_size=args.batch,
                         sampler=DistributedSampler(valid_ds, shuffle=False), num_workers=2)
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)

    step, epoch = 0, 0
    t0 = time.time()
    while step < args.steps:
        sampler.set_epoch(epoch)
        for ids in loader:
            ids = ids.to(dev, non_blocking=True)
            masked, labels = mask_tokens(ids)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                gen_loss, disc_loss, acc = model(masked, labels, ids)
                loss = gen_loss + args.disc_weight * disc_loss
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            step += 1
            if step % 100 == 0:
                stats = torch.stack([gen_loss.detach(), disc_loss.detach(), acc.detach()]).float()
                dist.all_reduce(stats, op=dist.ReduceOp.AVG)
                if rank == 0:
                    rate = 100 * args.batch * world / (time.time() - t0)
                    print(f"step {step} gen {stats[0]:.3f} disc {stats[1]:.4f} rtd_acc {stats[2]:.3f} "
                          f"lr {sched.get_last_lr()[0]:.2e} {rate:.0f} seq/s", flush=True)
                t0 = time.time()
            if step % args.save_every == 0:
                model.eval()
                tot = torch.zeros(3, device=dev)
                with torch.no_grad():
                    for vids in vloader:
                        vids = vids.to(dev)
                        vm, vl = mask_tokens(vids)
                        with torch.autocast("cuda", dtype=torch.bfloat16):
                            g, d, _ = model(vm, vl, vids)
                        tot += torch.stack([g.float(), d.float(), torch.ones((), device=dev)])
                dist.all_reduce(tot)
                model.train()
                if rank == 0:
                    print(f"[valid] step {step} gen {tot[0] / tot[2]:.3f} disc {tot[1] / tot[2]:.4f}")
                    torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(),
                                "sched": sched.state_dict(), "step": step, "epoch": epoch},
                               os.path.join(args.out, f"electra_{step}.pt"))
                    torch.save(model.module.discriminator.state_dict(),
                               os.path.join(args.out, "discriminator.pt"))
                dist.barrier()
            if step >= args.steps:
                break
        epoch += 1
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
