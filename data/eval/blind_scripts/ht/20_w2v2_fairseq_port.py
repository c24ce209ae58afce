"""Port of fairseq's wav2vec2_base_librispeech.yaml recipe to plain PyTorch DDP.

    torchrun --nnodes 8 --nproc_per_node 8 --rdzv_backend c10d --rdzv_endpoint $HEAD:29500 \
        20_w2v2_fairseq_port.py --cfg w2v2_base_ls960.yaml
"""
import argparse
import math
import os
import random
import time
from types import SimpleNamespace

import numpy as np
import soundfile as sf
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import yaml
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, DistributedSampler
from torch.utils.tensorboard import SummaryWriter

DEFAULTS = dict(
    data="/datasets/librispeech/manifest", save_dir="/checkpoint/w2v2_base_port",
    max_sample_size=250000, min_sample_size=32000, normalize=False,
    batch_size=10, lr=5e-4, warmup_updates=32000, max_update=400000, clip_norm=0.0,
    encoder_layers=12, encoder_embed_dim=768, encoder_ffn_embed_dim=3072, encoder_attention_heads=12,
    encoder_layerdrop=0.05, dropout_input=0.1, dropout_features=0.1, feature_grad_mult=0.1,
    final_dim=256, latent_vars=320, latent_groups=2, latent_temp=(2.0, 0.5, 0.999995),
    num_negatives=100, logit_temp=0.1, mask_prob=0.65, mask_length=10,
    loss_weights=(0.1, 10.0), log_interval=200, save_interval_updates=25000,
    conv_feature_layers=[(512, 10, 5)] + [(512, 3, 2)] * 4 + [(512, 2, 2)] * 2,
)


class GradMultiply(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, scale):
        ctx.scale = scale
        return x.new(x)

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.scale, None


class TransformerEncoder(nn.Module):
    def __init__(self, c):
        super().__init__()
        d = c.encoder_embed_dim
        self.pos_conv = nn.utils.parametrizations.weight_norm(nn.Conv1d(d, d, 128, padding=64, groups=16), dim=2)
        self.layer_norm = nn.LayerNorm(d)
        self.layers = nn.ModuleList([
            nn.TransformerEncoderLayer(d, c.encoder_attention_heads, c.encoder_ffn_embed_dim, 0.1, "gelu",
                                       batch_first=True) for _ in range(c.encoder_layers)])
        self.layerdrop = c.encoder_layerdrop

    def forward(self, x):
        x = x + F.gelu(self.pos_conv(x.transpose(1, 2))[..., :-1]).transpose(1, 2)
        x = F.dropout(self.layer_norm(x), 0.1, self.training)
        for layer in self.layers:
            if self.training and np.random.random() < self.layerdrop:
                continue
            x = layer(x)
        return x


class Wav2Vec2Model(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.c = c
        convs, in_d = [], 1
        for i, (dim, k, s) in enumerate(c.conv_feature_layers):
            convs.append(nn.Sequential(nn.Conv1d(in_d, dim, k, s, bias=False),
                                       nn.GroupNorm(dim, dim) if i == 0 else nn.Identity(), nn.GELU()))
            in_d = dim
        self.feature_extractor = nn.Sequential(*convs)
        self.layer_norm = nn.LayerNorm(512)
        self.post_extract_proj = nn.Linear(512, c.encoder_embed_dim)
        self.mask_emb = nn.Parameter(torch.FloatTensor(c.encoder_embed_dim).uniform_())
        self.encoder = TransformerEncoder(c)
        G, V = c.latent_groups, c.latent_vars
        self.quantizer_proj = nn.Linear(512, G * V)
        nn.init.normal_(self.quantizer_proj.weight, 0, 1)
        nn.init.zeros_(self.quantizer_proj.bias)
        self.quantizer_vars = nn.Parameter(torch.FloatTensor(1, G * V, c.final_dim // G).uniform_())
        self.project_q = nn.Linear(c.final_dim, c.final_dim)
        self.final_proj = nn.Linear(c.encoder_embed_dim, c.final_dim)
        self.max_temp, self.min_temp, self.temp_decay = c.latent_temp
        self.curr_temp = self.max_temp

    def set_num_updates(self, n):
        self.curr_temp = max(self.max_temp * self.temp_decay ** n, self.min_temp)

    def quantize(self, x):
        G, V = self.c.latent_groups, self.c.latent_vars
        B, T, _ = x.shape
        lg = self.quantizer_proj(x).float().view(B * T * G, V)
        avg = lg.view(B * T, G, V).softmax(-1).mean(0)
        prob_ppl = torch.exp(-(avg * torch.log(avg + 1e-7)).sum(-1)).sum()
        oh = F.gumbel_softmax(lg, tau=self.curr_temp, hard=True) if self.training else F.one_hot(lg.argmax(-1), V).float()
        q = (oh.view(B * T, -1, 1) * self.quantizer_vars.float()).view(B * T, G, V, -1).sum(-2)
        return q.view(B, T, -1), prob_ppl

    def forward(self, source, mask):
        f = self.feature_extractor(source.unsqueeze(1))
        f = GradMultiply.apply(f, self.c.feature_grad_mult)
        f = self.layer_norm(f.transpose(1, 2))
        pen = f.float().pow(2).mean()
        unmasked = F.dropout(f, self.c.dropout_features, self.training)
        x = self.post_extract_proj(F.dropout(f, self.c.dropout_input, self.training))
        x = torch.where(mask.unsqueeze(-1), self.mask_emb.to(x.dtype), x)
        x = self.final_proj(self.encoder(x))
        y, prob_ppl = self.quantize(unmasked)
        y = self.project_q(y.to(x.dtype))
        B, T, D = y.shape
        N = self.c.num_negatives
        with torch.no_grad():
            ni = torch.randint(0, T - 1, (B, T * N), device=y.device)
            ni += (ni >= torch.arange(T, device=y.device).repeat_interleave(N)).long()
            ni += (torch.arange(B, device=y.device) * T)[:, None]
        negs = y.reshape(-1, D)[ni.view(-1)].view(B, T, N, D)
        targets = torch.cat([y.unsqueeze(2), negs], 2)
        logits = F.cosine_similarity(x.float().unsqueeze(2), targets.float(), -1) / self.c.logit_temp
        return logits[mask], prob_ppl, pen


class FileAudioDataset(Dataset):
    def __init__(self, manifest, c):
        with open(manifest) as f:
            self.root = f.readline().strip()
            rows = [l.rstrip("\n").split("\t") for l in f]
        self.fnames = [p for p, n in rows if int(n) >= c.min_sample_size]
        self.max_size, self.normalize = c.max_sample_size, c.normalize

    def __len__(self):
        return len(self.fnames)

    def __getitem__(self, i):
        wav, _ = sf.read(os.path.join(self.root, self.fnames[i]), dtype="float32")
        wav = torch.from_numpy(wav)
        if self.normalize:
            wav = F.layer_norm(wav, wav.shape)
        return wav

    def collater(self, samples):
        size = min(min(len(s) for s in samples), self.max_size)
        out = []
        for s in samples:
            start = np.random.randint(0, len(s) - size + 1)
            out.append(s[start:start + size])
        return torch.stack(out)


def compute_mask(B, T, c):
    mask = np.zeros((B, T), bool)
    n = int(c.mask_prob * T / c.mask_length + np.random.rand())
    for b in range(B):
        idc = np.random.choice(T - c.mask_length, n, replace=False)
        mask[b, (idc[:, None] + np.arange(c.mask_length)).ravel()] = True
    return torch.from_numpy(mask)


def conv_len(n, c):
    for _, k, s in c.conv_feature_layers:
        n = (n - k) // s + 1
    return n


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cfg", default=None)
    cfg = dict(DEFAULTS)
    a = ap.parse_args()
    if a.cfg:
        cfg.update(yaml.safe_load(open(a.cfg)))
    c = SimpleNamespace(**cfg)

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    model = Wav2Vec2Model(c).to(device)
    model = DDP(model, device_ids=[local_rank], output_device=local_rank)
    # fairseq recipe: 64 GPUs, lr 5e-4; scale linearly for other allocations
    lr = c.lr * world / 64
    opt = torch.optim.Adam(model.parameters(), lr=lr, betas=(0.9, 0.98), eps=1e-6, weight_decay=0.01)
    scaler = torch.cuda.amp.GradScaler()

    train = FileAudioDataset(os.path.join(c.data, "train.tsv"), c)
    valid = FileAudioDataset(os.path.join(c.data, "valid.tsv"), c)
    sampler = DistributedSampler(train, shuffle=True, drop_last=True)
    loader = DataLoader(train, c.batch_size, sampler=sampler, collate_fn=train.collater, num_workers=6,
                        pin_memory=True, drop_last=True)
    vloader = DataLoader(torch.utils.data.Subset(valid, range(rank, len(valid), world)), c.batch_size,
                         collate_fn=valid.collater, num_workers=2)
    writer = SummaryWriter(os.path.join(c.save_dir, "tb")) if rank == 0 else None

    num_updates, epoch = 0, 0
    nv = c.latent_groups * c.latent_vars
    while num_updates < c.max_update:
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for src in loader:
            src = src.to(device, non_blocking=True)
            mask = compute_mask(src.size(0), conv_len(src.size(1), c), c).to(device)
            with torch.autocast("cuda", dtype=torch.float16):
                logits, ppl, pen = model(src, mask)
            loss = F.cross_entropy(logits.float(), torch.zeros(len(logits), dtype=torch.long, device=device))
            loss = loss + c.loss_weights[0] * (nv - ppl) / nv + c.loss_weights[1] * pen
            lr_now = lr * min(num_updates / c.warmup_updates,
                              max(0.0, (c.max_update - num_updates) / (c.max_update - c.warmup_updates)))
            for g in opt.param_groups:
                g["lr"] = lr_now
            opt.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            if c.clip_norm > 0:
                scaler.unscale_(opt)
                nn.utils.clip_grad_norm_(model.parameters(), c.clip_norm)
            scaler.step(opt)
            scaler.update()
            num_updates += 1
            model.module.set_num_updates(num_updates)

            if num_updates % c.log_interval == 0:
                s = torch.stack([loss.detach(), ppl.detach()]).float()
                dist.all_reduce(s, op=dist.ReduceOp.AVG)
                if writer:
                    writer.add_scalar("train/loss", s[0], num_updates)
                    writer.add_scalar("train/prob_perplexity", s[1], num_updates)
                    writer.add_scalar("train/temp", model.module.curr_temp, num_updates)
                    writer.add_scalar("train/lr", lr_now, num_updates)
                    writer.add_scalar("train/ups", c.log_interval / (time.time() - t0), num_updates)
                    t0 = time.time()
            if num_updates % c.save_interval_updates == 0 and rank == 0:
                torch.save({"model": model.module.state_dict(), "optimizer": opt.state_dict(),
                            "num_updates": num_updates, "cfg": cfg},
                           os.path.join(c.save_dir, f"checkpoint_{epoch}_{num_updates}.pt"))
            if num_updates >= c.max_update:
                break
        epoch += 1

        model.eval()
        tot = torch.zeros(2, device=device)
        with torch.no_grad():
            for src in vloader:
                src = src.to(device)
                mask = compute_mask(src.size(0), conv_len(src.size(1), c), c).to(device)
                with torch.autocast("cuda", dtype=torch.float16):
                    logits, _, _ = model.module(src, mask)
                tot += torch.tensor([(logits.argmax(-1) == 0).sum().item(), len(logits)], device=device,
                                    dtype=torch.float)
        dist.all_reduce(tot)
        if writer:
            writer.add_scalar("valid/accuracy", tot[0] / tot[1], num_updates)

    if rank == 0:
        torch.save({"model": model.module.state_dict(), "num_updates": num_updates, "cfg": cfg},
                   os.path.join(c.save_dir, "checkpoint_last.pt"))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
