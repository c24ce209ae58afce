"""wav2vec 2.0 BASE pretraining on LibriSpeech 960h.

Recipe follows the paper: 64 V100 x 1.4M samples per GPU ~= 1.6h of audio per
update.  On fewer GPUs we accumulate gradients to keep the same global batch.

    torchrun --nnodes=2 --nproc_per_node=8 --rdzv_backend=c10d \
        --rdzv_endpoint=$MASTER_ADDR:29400 02_w2v2_base_pretrain.py --config base.yaml
"""
import argparse
import contextlib
import math
import os
import random
import time

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

CONV = [(512, 10, 5)] + [(512, 3, 2)] * 4 + [(512, 2, 2)] * 2


def conv_len(n):
    for _, k, s in CONV:
        n = (n - k) // s + 1
    return n


class GumbelQuantizer(nn.Module):
    def __init__(self, in_dim, groups=2, num_vars=320, vq_dim=256, temp=(2.0, 0.5, 0.999995)):
        super().__init__()
        self.G, self.V = groups, num_vars
        self.codevectors = nn.Parameter(torch.empty(1, groups * num_vars, vq_dim // groups).uniform_())
        self.weight_proj = nn.Linear(in_dim, groups * num_vars)
        nn.init.normal_(self.weight_proj.weight, std=1.0)
        nn.init.zeros_(self.weight_proj.bias)
        self.max_temp, self.min_temp, self.decay = temp
        self.curr_temp = self.max_temp

    def set_num_updates(self, n):
        self.curr_temp = max(self.max_temp * self.decay ** n, self.min_temp)

    def forward(self, x):
        B, T, _ = x.shape
        logits = self.weight_proj(x).view(B * T * self.G, -1)
        hard = F.one_hot(logits.argmax(-1), self.V).float().view(B * T, self.G, -1)
        avg_probs = torch.softmax(logits.view(B * T, self.G, -1).float(), -1).mean(0)
        prob_ppl = torch.exp(-(avg_probs * torch.log(avg_probs + 1e-7)).sum(-1)).sum()
        if self.training:
            onehot = F.gumbel_softmax(logits.float(), tau=self.curr_temp, hard=True).type_as(logits)
        else:
            onehot = hard.view(B * T * self.G, -1).type_as(logits)
        onehot = onehot.view(B * T, -1, 1)
        q = (onehot * self.codevectors).view(B * T, self.G, self.V, -1).sum(-2)
        return q.view(B, T, -1), prob_ppl


class Wav2Vec2(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        d = cfg["encoder_dim"]
        convs, in_c = [], 1
        for i, (c, k, s) in enumerate(CONV):
            block = [nn.Conv1d(in_c, c, k, s, bias=False)]
            if i == 0:
                block.append(nn.GroupNorm(c, c))
            convs += block + [nn.GELU()]
            in_c = c
        self.feature_extractor = nn.Sequential(*convs)
        self.feat_ln = nn.LayerNorm(512)
        self.post_proj = nn.Linear(512, d)
        self.mask_emb = nn.Parameter(torch.empty(d).uniform_())
        self.pos_conv = nn.utils.parametrizations.weight_norm(
            nn.Conv1d(d, d, 128, padding=64, groups=16), name="weight", dim=2)
        self.enc_ln = nn.LayerNorm(d)
        self.layers = nn.ModuleList([
            nn.TransformerEncoderLayer(d, cfg["heads"], cfg["ffn_dim"], cfg["dropout"], "gelu", batch_first=True)
            for _ in range(cfg["layers"])])
        self.layerdrop = cfg["layerdrop"]
        self.quantizer = GumbelQuantizer(512, vq_dim=cfg["final_dim"])
        self.project_q = nn.Linear(cfg["final_dim"], cfg["final_dim"])
        self.final_proj = nn.Linear(d, cfg["final_dim"])
        self.n_neg = cfg["num_negatives"]

    def set_num_updates(self, n):
        self.quantizer.set_num_updates(n)

    def forward(self, wav, mask):
        feats = self.feat_ln(self.feature_extractor(wav.unsqueeze(1)).transpose(1, 2))
        feat_pen = feats.float().pow(2).mean()
        x = self.post_proj(feats)
        x = torch.where(mask.unsqueeze(-1), self.mask_emb.type_as(x), x)
        x = x + F.gelu(self.pos_conv(x.transpose(1, 2))[..., :-1]).transpose(1, 2)
        x = self.enc_ln(x)
        for layer in self.layers:
            if self.training and random.random() < self.layerdrop:
                continue
            x = layer(x)
        c = self.final_proj(x)

        q, prob_ppl = self.quantizer(feats)
        q = self.project_q(q)
        B, T, D = q.shape
        with torch.no_grad():
            neg = torch.randint(0, T - 1, (B, T * self.n_neg), device=q.device)
            tix = torch.arange(T, device=q.device).repeat_interleave(self.n_neg)
            neg = neg + (neg >= tix).long() + (torch.arange(B, device=q.device) * T).unsqueeze(1)
        negs = q.reshape(B * T, D)[neg.view(-1)].view(B, T, self.n_neg, D)
        targets = torch.cat([q.unsqueeze(2), negs], 2)
        logits = F.cosine_similarity(c.unsqueeze(2).float(), targets.float(), dim=-1) / 0.1
        return logits[mask], prob_ppl, feat_pen


def sample_mask(B, T, p, span):
    mask = np.zeros((B, T), dtype=bool)
    n = int(p * T / span + np.random.rand())
    for b in range(B):
        starts = np.random.choice(T - span, n, replace=False)
        for s in starts:
            mask[b, s:s + span] = True
    return torch.from_numpy(mask)


class RawAudio(Dataset):
    def __init__(self, tsv, max_len, min_len):
        with open(tsv) as f:
            self.root = f.readline().strip()
            rows = [l.rstrip().split("\t") for l in f]
        self.files = [(p, int(n)) for p, n in rows if int(n) >= min_len]
        self.max_len = max_len

    def __len__(self):
        return len(self.files)

    def __getitem__(self, i):
        wav, _ = sf.read(os.path.join(self.root, self.files[i][0]), dtype="float32")
        wav = torch.from_numpy(wav)
        wav = (wav - wav.mean()) / (wav.std() + 1e-5)
        if wav.numel() > self.max_len:
            s = random.randint(0, wav.numel() - self.max_len)
            wav = wav[s:s + self.max_len]
        return wav


def crop_collate(batch):
    n = min(w.numel() for w in batch)
    out = []
    for w in batch:
        s = random.randint(0, w.numel() - n)
        out.append(w[s:s + n])
    return torch.stack(out)


def lr_at(step, cfg):
    if step < cfg["warmup_updates"]:
        return cfg["lr"] * step / cfg["warmup_updates"]
    frac = (step - cfg["warmup_updates"]) / max(1, cfg["max_updates"] - cfg["warmup_updates"])
    return cfg["lr"] * max(0.0, 1.0 - frac)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", required=True)
    ap.add_argument("--out", default="/checkpoint/w2v2_base")
    args = ap.parse_args()
    cfg = yaml.safe_load(open(args.config))

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{local_rank}")
    torch.manual_seed(cfg["seed"] + rank)
    np.random.seed(cfg["seed"] + rank)
    random.seed(cfg["seed"] + rank)

    # keep the paper's global batch: 64 GPUs worth of samples per update
    update_freq = max(1, cfg["reference_gpus"] // world)

    model = Wav2Vec2(cfg).to(device)
    # LayerDrop skips whole transformer layers, so some parameters see no grad in a step
    model = DDP(model, device_ids=[local_rank], find_unused_parameters=True)
    opt = torch.optim.Adam(model.parameters(), lr=cfg["lr"], betas=(0.9, 0.98), eps=1e-6, weight_decay=0.01)
    scaler = torch.cuda.amp.GradScaler()

    step, epoch = 0, 0
    ckpt_path = os.path.join(args.out, "checkpoint_last.pt")
    if os.path.exists(ckpt_path):
        ck = torch.load(ckpt_path, map_location=device)
        model.module.load_state_dict(ck["model"])
        opt.load_state_dict(ck["opt"])
        scaler.load_state_dict(ck["scaler"])
        step, epoch = ck["step"], ck["epoch"]
        model.module.set_num_updates(step)

    train = RawAudio(os.path.join(cfg["data"], "train.tsv"), cfg["max_sample_size"], cfg["min_sample_size"])
    valid = RawAudio(os.path.join(cfg["data"], "valid.tsv"), cfg["max_sample_size"], cfg["min_sample_size"])
    tsampler = DistributedSampler(train, shuffle=True, seed=cfg["seed"], drop_last=True)
    # plain strided shard for validation: no padded duplicates, counts are summed below
    valid = torch.utils.data.Subset(valid, list(range(rank, len(valid), world)))
    tloader = DataLoader(train, batch_size=cfg["batch_size"], sampler=tsampler, collate_fn=crop_collate,
                         num_workers=8, pin_memory=True, drop_last=True, persistent_workers=True)
    vloader = DataLoader(valid, batch_size=cfg["batch_size"], shuffle=False, collate_fn=crop_collate,
                         num_workers=4)

    writer = SummaryWriter(os.path.join(args.out, "tb")) if rank == 0 else None
    model.train()
    micro = 0
    while step < cfg["max_updates"]:
        tsampler.set_epoch(epoch)
        for wav in tloader:
            micro += 1
            wav = wav.to(device, non_blocking=True)
            T = conv_len(wav.size(1))
            mask = sample_mask(wav.size(0), T, cfg["mask_prob"], cfg["mask_length"]).to(device)
            sync = micro % update_freq == 0
            ctx = contextlib.nullcontext() if sync else model.no_sync()
            with ctx:
                with torch.autocast("cuda", dtype=torch.float16):
                    logits, ppl, pen = model(wav, mask)
                n_codes = model.module.quantizer.G * model.module.quantizer.V
                loss = F.cross_entropy(logits, logits.new_zeros(logits.size(0), dtype=torch.long))
                loss = loss + 0.1 * (n_codes - ppl) / n_codes + 10.0 * pen
                scaler.scale(loss / update_freq).backward()
            if not sync:
                continue

            for g in opt.param_groups:
                g["lr"] = lr_at(step, cfg)
            scaler.unscale_(opt)
            nn.utils.clip_grad_norm_(model.parameters(), cfg["clip_norm"])
            scaler.step(opt)
            scaler.update()
            opt.zero_grad(set_to_none=True)
            step += 1
            model.module.set_num_updates(step)

            if step % cfg["log_interval"] == 0:
                t = torch.tensor([loss.item(), ppl.item()], device=device)
                dist.all_reduce(t)
                t /= world
                if rank == 0:
                    writer.add_scalar("train/loss", t[0].item(), step)
                    writer.add_scalar("train/prob_ppl", t[1].item(), step)
                    writer.add_scalar("train/temp", model.module.quantizer.curr_temp, step)
            if step >= cfg["max_updates"]:
                break
        epoch += 1

        # validation on the unwrapped module (no gradient sync needed)
        model.eval()
        acc = torch.zeros(3, device=device)
        with torch.no_grad():
            for wav in vloader:
                wav = wav.to(device)
                mask = sample_mask(wav.size(0), conv_len(wav.size(1)), cfg["mask_prob"], cfg["mask_length"]).to(device)
                with torch.autocast("cuda", dtype=torch.float16):
                    logits, _, _ = model.module(wav, mask)
                tgt = logits.new_zeros(logits.size(0), dtype=torch.long)
                acc[0] += F.cross_entropy(logits.float(), tgt, reduction="sum")
                acc[1] += (logits.argmax(-1) == 0).sum()
                acc[2] += logits.size(0)
        dist.all_reduce(acc)
        model.train()
        if rank == 0:
            writer.add_scalar("valid/loss", (acc[0] / acc[2]).item(), step)
            writer.add_scalar("valid/accuracy", (acc[1] / acc[2]).item(), step)
            os.makedirs(args.out, exist_ok=True)
            tmp = ckpt_path + ".tmp"
            torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(),
                        "scaler": scaler.state_dict(), "step": step, "epoch": epoch}, tmp)
            os.replace(tmp, ckpt_path)
        dist.barrier()

    if writer is not None:
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
