#!/usr/bin/env python
# MaskGIT on precomputed MaskGIT-VQ tokens (16x16 per image) with periodic FID-50k evaluation.
#
# torchrun --nnodes=4 --nproc_per_node=8 --node_rank=$NODE_RANK --master_addr=$MASTER_ADDR \
#     --master_port=29411 05_maskgit_in1k.py --tokens /mnt/shared/tok/in1k_256.npy \
#     --labels /mnt/shared/tok/in1k_256_labels.npy --tokenizer /mnt/shared/ckpt/maskgit_vq.pt \
#     --fid_ref /mnt/shared/fid/VIRTUAL_imagenet256_labeled.npz --out /mnt/shared/runs/maskgit_b
import argparse
import math
import os

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import wandb
from pytorch_fid.fid_score import calculate_frechet_distance
from pytorch_fid.inception import InceptionV3
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

from lab_tokenizers import MaskGITVQ

MASK_SCHEDULES = {
    "cosine": lambda r: torch.cos(r * math.pi / 2),
    "linear": lambda r: 1 - r,
    "square": lambda r: 1 - r ** 2,
}


class BidirectionalTransformer(nn.Module):
    def __init__(self, vocab, n_cls, seq_len, dim, depth, heads):
        super().__init__()
        self.mask_token = vocab
        self.embed = nn.Embedding(vocab + 1 + n_cls + 1, dim)  # codes, [MASK], classes, null class
        self.cls_offset = vocab + 1
        self.pos = nn.Parameter(torch.randn(1, seq_len + 1, dim) * 0.02)
        layer = nn.TransformerEncoderLayer(dim, heads, 4 * dim, dropout=0.1, activation="gelu",
                                           batch_first=True, norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, depth)
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab)

    def forward(self, tokens, y):
        x = torch.cat([(y + self.cls_offset)[:, None], tokens], dim=1)
        h = self.encoder(self.embed(x) + self.pos)
        return self.head(self.norm(h))[:, 1:]


@torch.no_grad()
def generate(net, y, seq_len, steps, schedule, temp=4.5, cfg_scale=2.0, null_cls=1000):
    b = y.shape[0]
    tok = torch.full((b, seq_len), net.mask_token, device=y.device)
    for t in range(steps):
        logits_c = net(tok, y)
        logits_u = net(tok, torch.full_like(y, null_cls))
        logits = logits_u + cfg_scale * (logits_c - logits_u)
        probs = logits.float().softmax(-1)
        sampled = torch.distributions.Categorical(probs=probs).sample()
        masked = tok == net.mask_token
        sampled = torch.where(masked, sampled, tok)
        conf = probs.gather(-1, sampled[..., None]).squeeze(-1)
        conf = torch.where(masked, conf, torch.ones_like(conf) * 1e9)
        ratio = MASK_SCHEDULES[schedule](torch.tensor((t + 1) / steps))
        n_keep_masked = int(seq_len * ratio)
        if n_keep_masked == 0:
            return sampled
        g = -torch.log(-torch.log(torch.rand_like(conf)))
        conf = torch.log(conf) + temp * (1 - (t + 1) / steps) * g
        cut = torch.topk(conf, n_keep_masked, dim=-1, largest=False).values[:, -1:]
        tok = torch.where(conf <= cut, torch.full_like(sampled, net.mask_token), sampled)
    return tok


@torch.no_grad()
def fid_eval(net, tokenizer, inception, args, device, world):
    net.eval()
    per_rank = args.fid_n // world
    feats = []
    for i in range(0, per_rank, args.gen_bs):
        b = min(args.gen_bs, per_rank - i)
        y = torch.randint(0, 1000, (b,), device=device)
        tok = generate(net.module, y, args.seq_len, args.gen_steps, args.schedule, cfg_scale=args.cfg)
        img = (tokenizer.decode_tokens(tok.view(b, 16, 16)).clamp(-1, 1) + 1) / 2
        feats.append(inception(img)[0].squeeze(-1).squeeze(-1).double().cpu())
    feats = torch.cat(feats).numpy()
    ref = np.load(args.fid_ref)
    fid = calculate_frechet_distance(feats.mean(0), np.cov(feats, rowvar=False), ref["mu"], ref["sigma"])
    net.train()
    return fid


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", required=True)
    ap.add_argument("--labels", required=True)
    ap.add_argument("--tokenizer", required=True)
    ap.add_argument("--fid_ref", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--dim", type=int, default=768)
    ap.add_argument("--depth", type=int, default=24)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--seq_len", type=int, default=256)
    ap.add_argument("--bs", type=int, default=64)
    ap.add_argument("--gen_bs", type=int, default=125)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--epochs", type=int, default=300)
    ap.add_argument("--schedule", default="cosine")
    ap.add_argument("--gen_steps", type=int, default=12)
    ap.add_argument("--cfg", type=float, default=2.0)
    ap.add_argument("--fid_n", type=int, default=50000)
    ap.add_argument("--fid_every", type=int, default=25)
    args = ap.parse_args()

    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    torch.manual_seed(42 + rank)

    tokens = torch.from_numpy(np.load(args.tokens, mmap_mode="r")[:].astype(np.int64))
    labels = torch.from_numpy(np.load(args.labels).astype(np.int64))
    ds = TensorDataset(tokens, labels)
    sampler = DistributedSampler(ds, shuffle=True, seed=0)
    dl = DataLoader(ds, batch_size=args.bs, sampler=sampler, num_workers=2, drop_last=True, pin_memory=True)

    tokenizer = MaskGITVQ.load(args.tokenizer).to(device).eval()
    inception = InceptionV3([3]).to(device).eval()

    net = BidirectionalTransformer(1024, 1000, args.seq_len, args.dim, args.depth, args.heads).to(device)
    net = DDP(net, device_ids=[local_rank])
    opt = torch.optim.AdamW(net.parameters(), lr=args.lr, betas=(0.9, 0.96), weight_decay=0.045)

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        wandb.init(project="maskgit", name=os.path.basename(args.out), config=vars(args))

    step = 0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        for tok, y in dl:
            tok, y = tok.to(device, non_blocking=True), y.to(device, non_blocking=True)
            b = tok.shape[0]
            y = torch.where(torch.rand(b, device=device) < 0.1, torch.full_like(y, 1000), y)
            ratio = MASK_SCHEDULES[args.schedule](torch.rand(b, device=device))
            n_mask = (ratio * args.seq_len).ceil().clamp_min(1)
            scores = torch.rand(b, args.seq_len, device=device)
            kth = scores.sort(dim=-1).values.gather(1, (n_mask.long() - 1)[:, None])
            mask = scores <= kth
            inp = tok.masked_fill(mask, 1024)

            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = net(inp, y)
            loss = F.cross_entropy(logits.float()[mask], tok[mask], label_smoothing=0.1)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(net.parameters(), 3.0)
            opt.step()
            step += 1

            if step % 100 == 0:
                lg = loss.detach().clone()
                dist.all_reduce(lg, op=dist.ReduceOp.AVG)
                if rank == 0:
                    wandb.log({"train/loss": lg.item(), "epoch": epoch}, step=step)

        if (epoch + 1) % args.fid_every == 0:
            fid = fid_eval(net, tokenizer, inception, args, device, world)
            if rank == 0:
                wandb.log({"eval/fid50k": fid}, step=step)
                print(f"epoch {epoch} FID-50k {fid:.3f}", flush=True)
                torch.save({"net": net.module.state_dict(), "opt": opt.state_dict(), "epoch": epoch},
                           os.path.join(args.out, f"ckpt_{epoch:04d}.pt"))
            dist.barrier()

    if rank == 0:
        wandb.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
