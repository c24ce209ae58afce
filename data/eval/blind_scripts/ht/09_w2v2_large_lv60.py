"""wav2vec 2.0 LARGE (LV-60k) pretraining, resumable after preemption.

The job is requeued by the scheduler; on restart it picks up checkpoint_last.pt
from the shared checkpoint directory.

    torchrun --nnodes=8 --nproc_per_node=8 --rdzv_backend=c10d --rdzv_endpoint=$HEAD:29500 \
        09_w2v2_large_lv60.py --data /lustre/librilight --ckpt-dir /lustre/ckpt/w2v2_large
"""
import argparse
import logging
import math
import os
import random
import signal
import time

import numpy as np
import soundfile as sf
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, DistributedSampler

log = logging.getLogger("w2v2")


class Cfg:
    conv = [(512, 10, 5)] + [(512, 3, 2)] * 4 + [(512, 2, 2)] * 2
    d, layers, heads, ffn = 1024, 24, 16, 4096
    final_dim, G, V, negatives = 768, 2, 320, 100
    mask_prob, mask_len = 0.65, 10


def frames_of(n):
    for _, k, s in Cfg.conv:
        n = (n - k) // s + 1
    return n


class Wav2Vec2Large(nn.Module):
    def __init__(self):
        super().__init__()
        blocks, c_in = [], 1
        for c, k, s in Cfg.conv:
            blocks.append(nn.Sequential(nn.Conv1d(c_in, c, k, s), nn.Dropout(0.0),
                                        nn.GroupNorm(1, c), nn.GELU()))
            c_in = c
        self.feature_extractor = nn.Sequential(*blocks)
        self.layer_norm = nn.LayerNorm(512)
        self.post_extract_proj = nn.Linear(512, Cfg.d)
        self.mask_emb = nn.Parameter(torch.FloatTensor(Cfg.d).uniform_())
        self.pos_conv = nn.Conv1d(Cfg.d, Cfg.d, 128, padding=64, groups=16)
        self.encoder = nn.TransformerEncoder(
            nn.TransformerEncoderLayer(Cfg.d, Cfg.heads, Cfg.ffn, 0.0, "gelu", batch_first=True, norm_first=True),
            Cfg.layers, norm=nn.LayerNorm(Cfg.d), enable_nested_tensor=False)
        self.q_weight_proj = nn.Linear(512, Cfg.G * Cfg.V)
        self.q_vars = nn.Parameter(torch.FloatTensor(Cfg.G * Cfg.V, Cfg.final_dim // Cfg.G).uniform_())
        self.project_q = nn.Linear(Cfg.final_dim, Cfg.final_dim)
        self.final_proj = nn.Linear(Cfg.d, Cfg.final_dim)
        self.gumbel_temp = 2.0

    def quantize(self, f):
        B, T, _ = f.shape
        lg = self.q_weight_proj(f).float().view(B * T, Cfg.G, Cfg.V)
        avg = lg.softmax(-1).mean(0)
        ppl = torch.exp(-(avg * (avg + 1e-7).log()).sum(-1)).sum()
        oh = F.gumbel_softmax(lg, tau=self.gumbel_temp, hard=True) if self.training else \
            F.one_hot(lg.argmax(-1), Cfg.V).float()
        q = torch.einsum("ngv,gvd->ngd", oh, self.q_vars.float().view(Cfg.G, Cfg.V, -1))
        return q.reshape(B, T, -1), ppl

    def forward(self, wav, mask):
        f = self.layer_norm(self.feature_extractor(wav[:, None]).transpose(1, 2))
        pen = f.float().pow(2).mean()
        x = self.post_extract_proj(f)
        x = torch.where(mask[..., None], self.mask_emb.type_as(x), x)
        x = x + F.gelu(self.pos_conv(x.transpose(1, 2))[..., :-1]).transpose(1, 2)
        c = self.final_proj(self.encoder(x))
        q, ppl = self.quantize(f)
        q = self.project_q(q.type_as(c))
        B, T, D = q.shape
        with torch.no_grad():
            ni = torch.randint(0, T - 1, (B, T, Cfg.negatives), device=q.device)
            ni += (ni >= torch.arange(T, device=q.device)[None, :, None]).long()
            ni += torch.arange(B, device=q.device)[:, None, None] * T
        negs = q.reshape(-1, D)[ni.view(-1)].view(B, T, Cfg.negatives, D)
        logits = F.cosine_similarity(c.float()[:, :, None], torch.cat([q[:, :, None], negs], 2).float(), -1) / 0.1
        return logits[mask], ppl, pen


class AudioDir(Dataset):
    def __init__(self, tsv, max_len=320000, min_len=32000):
        with open(tsv) as fh:
            self.root = fh.readline().strip()
            self.rows = [(p, int(n)) for p, n in (l.rstrip("\n").split("\t") for l in fh) if int(n) >= min_len]
        self.max_len = max_len

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        wav, _ = sf.read(os.path.join(self.root, self.rows[i][0]), dtype="float32")
        if len(wav) > self.max_len:
            o = random.randint(0, len(wav) - self.max_len)
            wav = wav[o:o + self.max_len]
        wav = (wav - wav.mean()) / np.sqrt(wav.var() + 1e-7)
        return torch.from_numpy(wav)


def collate_crop(batch):
    n = min(w.numel() for w in batch)
    starts = [random.randint(0, w.numel() - n) for w in batch]
    return torch.stack([w[s:s + n] for w, s in zip(batch, starts)])


def make_mask(B, T):
    m = np.zeros((B, T), bool)
    k = int(Cfg.mask_prob * T / Cfg.mask_len + np.random.rand())
    for b in range(B):
        s = np.random.choice(T - Cfg.mask_len, k, replace=False)
        m[b, (s[:, None] + np.arange(Cfg.mask_len)).ravel()] = True
    return torch.from_numpy(m)


class Trainer:
    def __init__(self, args, rank, world, local_rank):
        self.args, self.rank, self.world = args, rank, world
        self.dev = torch.device("cuda", local_rank)
        self.model = DDP(Wav2Vec2Large().to(self.dev), device_ids=[local_rank])
        # lr 3e-4 was tuned for 128 GPUs; keep lr/GPU constant on smaller allocations
        self.lr = args.lr * world / 128
        self.opt = torch.optim.Adam(self.model.parameters(), lr=self.lr, betas=(0.9, 0.98), eps=1e-6,
                                    weight_decay=0.01)
        self.scaler = torch.cuda.amp.GradScaler(init_scale=128)
        self.step, self.epoch = 0, 0
        self.ckpt = os.path.join(args.ckpt_dir, "checkpoint_last.pt")

    def lr_at(self, s):
        w, m = self.args.warmup, self.args.max_update
        return self.lr * (s / w if s < w else max(0.0, (m - s) / (m - w)))

    def save(self):
        if self.rank == 0:
            os.makedirs(self.args.ckpt_dir, exist_ok=True)
            torch.save({"model": self.model.module.state_dict(), "opt": self.opt.state_dict(),
                        "scaler": self.scaler.state_dict(), "step": self.step, "epoch": self.epoch},
                       self.ckpt + ".tmp")
            os.replace(self.ckpt + ".tmp", self.ckpt)
            log.info("saved %s at step %d", self.ckpt, self.step)
        dist.barrier()

    def load(self):
        if not os.path.exists(self.ckpt):
            return
        state = torch.load(self.ckpt)
        self.model.module.load_state_dict(state["model"])
        self.opt.load_state_dict(state["opt"])
        self.scaler.load_state_dict(state["scaler"])
        self.step, self.epoch = state["step"], state["epoch"]
        self.model.module.gumbel_temp = max(0.1, 2.0 * 0.999995 ** self.step)
        log.info("resumed from step %d", self.step)

    def train_step(self, wav):
        wav = wav.to(self.dev, non_blocking=True)
        mask = make_mask(wav.size(0), frames_of(wav.size(1))).to(self.dev)
        with torch.autocast("cuda", dtype=torch.float16):
            logits, ppl, pen = self.model(wav, mask)
        nv = Cfg.G * Cfg.V
        loss = F.cross_entropy(logits.float(), torch.zeros(len(logits), dtype=torch.long, device=self.dev))
        loss = loss + 0.1 * (nv - ppl) / nv + 10 * pen
        for g in self.opt.param_groups:
            g["lr"] = self.lr_at(self.step)
        self.opt.zero_grad(set_to_none=True)
        self.scaler.scale(loss).backward()
        self.scaler.unscale_(self.opt)
        nn.utils.clip_grad_norm_(self.model.parameters(), 25.0)
        self.scaler.step(self.opt)
        self.scaler.update()
        self.step += 1
        self.model.module.gumbel_temp = max(0.1, 2.0 * 0.999995 ** self.step)
        return loss.detach(), ppl.detach()

    @torch.no_grad()
    def validate(self, loader):
        net = self.model.module
        net.eval()
        acc = torch.zeros(2, device=self.dev)
        for wav in loader:
            wav = wav.to(self.dev)
            mask = make_mask(wav.size(0), frames_of(wav.size(1))).to(self.dev)
            with torch.autocast("cuda", dtype=torch.float16):
                logits, _, _ = net(wav, mask)
            acc += torch.stack([(logits.argmax(-1) == 0).sum().float(), torch.tensor(float(len(logits)), device=self.dev)])
        net.train()
        dist.all_reduce(acc)
        return (acc[0] / acc[1]).item()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--ckpt-dir", required=True)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--warmup", type=int, default=32000)
    p.add_argument("--max-update", type=int, default=600000)
    p.add_argument("--save-interval", type=int, default=5000)
    args = p.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format="%(asctime)s [%(name)s] %(message)s")

    trainer = Trainer(args, rank, world, local_rank)
    trainer.load()

    train = AudioDir(os.path.join(args.data, "train.tsv"))
    valid = AudioDir(os.path.join(args.data, "valid.tsv"))
    sampler = DistributedSampler(train, shuffle=True, seed=1, drop_last=True)
    loader = DataLoader(train, batch_size=args.batch_size, sampler=sampler, collate_fn=collate_crop,
                        num_workers=10, pin_memory=True, drop_last=True, prefetch_factor=4)
    vloader = DataLoader(torch.utils.data.Subset(valid, range(rank, len(valid), world)),
                         batch_size=args.batch_size, collate_fn=collate_crop, num_workers=2)

    stop = {"flag": False}
    signal.signal(signal.SIGUSR1, lambda *_: stop.update(flag=True))

    while trainer.step < args.max_update:
        sampler.set_epoch(trainer.epoch)
        t0 = time.time()
        for wav in loader:
            loss, ppl = trainer.train_step(wav)
            if trainer.step % 200 == 0:
                s = torch.stack([loss, ppl])
                dist.all_reduce(s, op=dist.ReduceOp.AVG)
                log.info("step %d loss %.4f ppl %.1f lr %.2e %.2fs/it", trainer.step, s[0], s[1],
                         trainer.lr_at(trainer.step), (time.time() - t0) / 200)
                t0 = time.time()
            # preemption notice: agree across ranks before saving
            flag = torch.tensor([float(stop["flag"])], device=trainer.dev)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            if flag.item() > 0 or trainer.step % args.save_interval == 0:
                trainer.save()
                if flag.item() > 0:
                    dist.destroy_process_group()
                    return
            if trainer.step >= args.max_update:
                break
        trainer.epoch += 1
        log.info("epoch %d valid acc %.4f", trainer.epoch, trainer.validate(vloader))
        trainer.save()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
