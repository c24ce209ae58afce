"""MaskGIT (bidirectional transformer over VQGAN tokens) trained with FSDP.

Tokens are produced on the fly by a frozen VQGAN f16 tokenizer. Every `eval_every` steps
we sample images with the iterative cosine-schedule decoder and compute FID against
precomputed Inception statistics of the training set.

    torchrun --nnodes=2 --nproc_per_node=8 --rdzv_backend=c10d --rdzv_endpoint=$MASTER:29500 \
        02_maskgit_fsdp_fid.py --data /shared/imagenet/train --vqgan /shared/ckpt/vqgan_f16_1024.pt \
        --fid_stats /shared/fid/imagenet256_train.npz --out /shared/runs/maskgit_l
"""
import argparse
import functools
import math
import os

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from scipy import linalg
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp import FullStateDictConfig, MixedPrecision, StateDictType
from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from torchvision import datasets, transforms
from pytorch_fid.inception import InceptionV3

from lab_tokenizers.vqgan import VQGAN


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--vqgan", required=True)
    p.add_argument("--fid_stats", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--codebook_size", type=int, default=1024)
    p.add_argument("--num_classes", type=int, default=1000)
    p.add_argument("--dim", type=int, default=1024)
    p.add_argument("--depth", type=int, default=24)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--batch_size", type=int, default=32, help="per GPU")
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--steps", type=int, default=300_000)
    p.add_argument("--eval_every", type=int, default=20_000)
    p.add_argument("--fid_samples", type=int, default=10_000)
    p.add_argument("--sample_steps", type=int, default=8)
    p.add_argument("--label_drop", type=float, default=0.1)
    return p.parse_args()


class Block(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.ln1 = nn.LayerNorm(dim)
        self.attn = nn.MultiheadAttention(dim, heads, batch_first=True)
        self.ln2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x):
        h = self.ln1(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class MaskGIT(nn.Module):
    def __init__(self, codebook_size, num_classes, seq_len, dim, depth, heads):
        super().__init__()
        self.mask_id = codebook_size                 # extra token after the codebook
        self.tok = nn.Embedding(codebook_size + 1, dim)
        self.cls = nn.Embedding(num_classes + 1, dim)  # last index = unconditional
        self.pos = nn.Parameter(torch.zeros(1, seq_len + 1, dim))
        self.blocks = nn.ModuleList([Block(dim, heads) for _ in range(depth)])
        self.ln = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, codebook_size)
        nn.init.trunc_normal_(self.pos, std=0.02)

    def forward(self, idx, y):
        x = torch.cat([self.cls(y)[:, None], self.tok(idx)], dim=1) + self.pos
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.ln(x[:, 1:]))


def cosine_mask_ratio(r):
    return torch.cos(r * math.pi / 2)


@torch.no_grad()
def sample(model, y, seq_len, mask_id, steps, temperature=4.5):
    b = y.shape[0]
    idx = torch.full((b, seq_len), mask_id, device=y.device, dtype=torch.long)
    for t in range(steps):
        logits = model(idx, y).float()
        probs = F.softmax(logits, dim=-1)
        pred = torch.multinomial(probs.view(-1, probs.shape[-1]), 1).view(b, seq_len)
        conf = torch.gather(probs, -1, pred[..., None]).squeeze(-1)
        unknown = idx == mask_id
        pred = torch.where(unknown, pred, idx)
        conf = torch.where(unknown, conf, torch.full_like(conf, float("inf")))
        n_mask = int(math.floor(seq_len * cosine_mask_ratio(torch.tensor((t + 1) / steps)).item()))
        if n_mask == 0:
            idx = pred
            break
        gumbel = -torch.log(-torch.log(torch.rand_like(conf).clamp_min(1e-20)))
        noisy = torch.log(conf.clamp_min(1e-20)) + temperature * (1 - (t + 1) / steps) * gumbel
        thresh = noisy.sort(dim=-1).values[:, n_mask - 1:n_mask]
        idx = torch.where(noisy <= thresh, torch.full_like(pred, mask_id), pred)
    return idx


def fid_from_feats(feats, mu_ref, sigma_ref):
    mu, sigma = feats.mean(0), np.cov(feats, rowvar=False)
    covmean, _ = linalg.sqrtm(sigma.dot(sigma_ref), disp=False)
    covmean = covmean.real
    return float(((mu - mu_ref) ** 2).sum() + np.trace(sigma + sigma_ref - 2 * covmean))


@torch.no_grad()
def evaluate_fid(model, vqgan, inception, args, device, rank, world):
    model.eval()
    n_local = math.ceil(args.fid_samples / world)
    feats = []
    g = torch.Generator(device=device).manual_seed(1000 + rank)
    for s in range(0, n_local, args.batch_size):
        b = min(args.batch_size, n_local - s)
        y = torch.randint(0, args.num_classes, (b,), device=device, generator=g)
        idx = sample(model, y, vqgan.num_tokens, args.codebook_size, args.sample_steps)
        img = vqgan.decode_indices(idx).clamp(-1, 1) * 0.5 + 0.5
        img = F.interpolate(img, size=299, mode="bilinear", align_corners=False)
        feats.append(inception(img)[0].flatten(1))
    feats = torch.cat(feats)
    gathered = [torch.empty_like(feats) for _ in range(world)]
    dist.all_gather(gathered, feats)
    model.train()
    if rank == 0:
        allf = torch.cat(gathered)[: args.fid_samples].double().cpu().numpy()
        ref = np.load(args.fid_stats)
        return fid_from_feats(allf, ref["mu"], ref["sigma"])
    return None


def save_checkpoint(model, opt, step, path, rank):
    cfg = FullStateDictConfig(offload_to_cpu=True, rank0_only=True)
    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, cfg):
        state = model.state_dict()
        optim_state = FSDP.optim_state_dict(model, opt)
    if rank == 0:
        tmp = path + ".tmp"
        torch.save({"model": state, "opt": optim_state, "step": step}, tmp)
        os.replace(tmp, path)
    dist.barrier()


def main():
    args = parse()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(0)

    vqgan = VQGAN.from_config_file(args.vqgan.replace(".pt", ".yaml"))
    vqgan.load_state_dict(torch.load(args.vqgan, map_location="cpu")["state_dict"])
    vqgan = vqgan.to(device).eval().requires_grad_(False)
    inception = InceptionV3([InceptionV3.BLOCK_INDEX_BY_DIM[2048]]).to(device).eval()

    model = MaskGIT(args.codebook_size, args.num_classes, vqgan.num_tokens, args.dim, args.depth, args.heads)
    model = FSDP(
        model,
        auto_wrap_policy=functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={Block}),
        mixed_precision=MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
                                       buffer_dtype=torch.float32),
        device_id=local_rank,
        use_orig_params=True,
    )
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.96), weight_decay=0.045)

    tf = transforms.Compose([transforms.Resize(256), transforms.CenterCrop(256), transforms.RandomHorizontalFlip(),
                             transforms.ToTensor(), transforms.Normalize([0.5] * 3, [0.5] * 3)])
    ds = datasets.ImageFolder(args.data, transform=tf)
    sampler = DistributedSampler(ds, shuffle=True, seed=0, drop_last=True)
    loader = DataLoader(ds, batch_size=args.batch_size, sampler=sampler, num_workers=10,
                        pin_memory=True, drop_last=True)

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
    step, epoch = 0, 0
    while step < args.steps:
        sampler.set_epoch(epoch)
        for x, y in loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            with torch.no_grad():
                idx = vqgan.encode_indices(x).flatten(1)
            b, n = idx.shape
            drop = torch.rand(b, device=device) < args.label_drop
            y = torch.where(drop, torch.full_like(y, args.num_classes), y)
            r = cosine_mask_ratio(torch.rand(b, device=device))
            n_mask = (r * n).ceil().clamp(min=1).long()
            ranks_ = torch.rand(b, n, device=device).argsort(dim=-1).argsort(dim=-1)
            mask = ranks_ < n_mask[:, None]
            inp = torch.where(mask, torch.full_like(idx, args.codebook_size), idx)

            logits = model(inp, y)
            loss = F.cross_entropy(logits[mask].float(), idx[mask], label_smoothing=0.1)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            model.clip_grad_norm_(1.0)
            opt.step()
            step += 1

            if step % 100 == 0:
                l = loss.detach().clone()
                dist.all_reduce(l, op=dist.ReduceOp.AVG)
                if rank == 0:
                    print(f"step {step} ep {epoch} loss {l.item():.4f}", flush=True)
            if step % args.eval_every == 0:
                fid = evaluate_fid(model, vqgan, inception, args, device, rank, world)
                if rank == 0:
                    print(f"step {step} FID@{args.fid_samples} {fid:.2f}", flush=True)
                save_checkpoint(model, opt, step, os.path.join(args.out, f"maskgit_{step:07d}.pt"), rank)
            if step >= args.steps:
                break
        epoch += 1

    save_checkpoint(model, opt, step, os.path.join(args.out, "maskgit_final.pt"), rank)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
