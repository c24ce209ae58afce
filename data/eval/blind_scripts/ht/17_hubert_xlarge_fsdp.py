"""HuBERT X-Large (~1B params) pretraining on Libri-Light 60k with PyTorch FSDP.

    torchrun --nnodes 16 --nproc_per_node 8 --rdzv_backend c10d --rdzv_endpoint $HEAD:29500 \
        17_hubert_xlarge_fsdp.py --data /lustre/ll60k --labels /lustre/ll60k/km_large_l9_500 \
        --out /lustre/exp/hubert_xlarge
"""
import argparse
import functools
import os
import random
import time

import numpy as np
import soundfile as sf
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (CheckpointImpl, apply_activation_checkpointing,
                                                                         checkpoint_wrapper)
from torch.distributed.fsdp import FullStateDictConfig, FullyShardedDataParallel as FSDP
from torch.distributed.fsdp import MixedPrecision, ShardingStrategy, StateDictType
from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy
from torch.utils.data import DataLoader, Dataset, DistributedSampler

SPEC = [(512, 10, 5)] + [(512, 3, 2)] * 4 + [(512, 2, 2)] * 2


def nframes(n):
    for _, k, s in SPEC:
        n = (n - k) // s + 1
    return n


class Block(nn.Module):
    def __init__(self, d, h, ffn, p=0.0):
        super().__init__()
        self.ln1 = nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, h, dropout=p, batch_first=True)
        self.ln2 = nn.LayerNorm(d)
        self.ffn = nn.Sequential(nn.Linear(d, ffn), nn.GELU(), nn.Linear(ffn, d))

    def forward(self, x):
        y = self.ln1(x)
        x = x + self.attn(y, y, y, need_weights=False)[0]
        return x + self.ffn(self.ln2(x))


class HubertXL(nn.Module):
    def __init__(self, n_classes, d=1280, depth=48, heads=16, ffn=5120, final_dim=1024):
        super().__init__()
        conv, c = [], 1
        for o, k, s in SPEC:
            conv += [nn.Conv1d(c, o, k, s), nn.GroupNorm(1, o), nn.GELU()]
            c = o
        self.cnn = nn.Sequential(*conv)
        self.cnn_ln = nn.LayerNorm(512)
        self.proj = nn.Linear(512, d)
        self.mask_emb = nn.Parameter(torch.empty(d).uniform_())
        self.pos = nn.Conv1d(d, d, 128, padding=64, groups=16)
        self.blocks = nn.ModuleList([Block(d, heads, ffn) for _ in range(depth)])
        self.out_ln = nn.LayerNorm(d)
        self.final_proj = nn.Linear(d, final_dim)
        self.label_embs = nn.Parameter(torch.empty(n_classes, final_dim).uniform_())

    def forward(self, wav, mask):
        f = self.cnn_ln(self.cnn(wav[:, None]).transpose(1, 2))
        x = torch.where(mask[..., None], self.mask_emb.to(f.dtype), self.proj(f))
        x = x + F.gelu(self.pos(x.transpose(1, 2))[..., :-1]).transpose(1, 2)
        for b in self.blocks:
            x = b(x)
        y = F.normalize(self.final_proj(self.out_ln(x)).float(), dim=-1)
        return y @ F.normalize(self.label_embs.float(), dim=-1).T / 0.1, f.float().pow(2).mean()


class KmData(Dataset):
    def __init__(self, tsv, km, crop=250000):
        with open(tsv) as f:
            root = f.readline().strip()
            self.wavs = [os.path.join(root, l.split("\t")[0]) for l in f.read().splitlines()]
        with open(km) as f:
            self.labs = f.read().splitlines()
        assert len(self.wavs) == len(self.labs)
        self.crop = crop

    def __len__(self):
        return len(self.wavs)

    def __getitem__(self, i):
        w, _ = sf.read(self.wavs[i], dtype="float32")
        l = np.array(self.labs[i].split(), dtype=np.int64)
        if len(w) > self.crop:
            s = random.randint(0, (len(w) - self.crop) // 320)
            w, l = w[s * 320:s * 320 + self.crop], l[s:s + self.crop // 320]
        return torch.from_numpy(w), torch.from_numpy(l)


def collate(b):
    n = min(len(w) for w, _ in b)
    t = min(nframes(n), min(len(l) for _, l in b))
    return torch.stack([w[:n] for w, _ in b]), torch.stack([l[:t] for _, l in b])


def mask_for(B, T, p=0.8, L=10):
    m = torch.zeros(B, T, dtype=torch.bool)
    k = int(p * T / L + random.random())
    for i in range(B):
        for s in random.sample(range(T - L), k):
            m[i, s:s + L] = True
    return m


def masked_loss(logits, lab, mask):
    m = mask[:, :lab.size(1)]
    lg = logits[:, :lab.size(1)][m]
    return F.cross_entropy(lg, lab[m]), (lg.argmax(-1) == lab[m]).float().sum(), m.sum()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--labels", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--num-classes", type=int, default=500)
    ap.add_argument("--batch-size", type=int, default=2)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--warmup", type=int, default=32000)
    ap.add_argument("--max-update", type=int, default=400000)
    ap.add_argument("--save-every", type=int, default=20000)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", local_rank)
    torch.manual_seed(0)

    model = HubertXL(args.num_classes)
    model = FSDP(model,
                 auto_wrap_policy=functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={Block}),
                 mixed_precision=MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
                                                buffer_dtype=torch.float32),
                 sharding_strategy=ShardingStrategy.FULL_SHARD, device_id=local_rank, limit_all_gathers=True)
    apply_activation_checkpointing(
        model, checkpoint_wrapper_fn=functools.partial(checkpoint_wrapper, checkpoint_impl=CheckpointImpl.NO_REENTRANT),
        check_fn=lambda m: isinstance(m, Block))
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.98), eps=1e-6, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: s / args.warmup if s < args.warmup else max(0.0, (args.max_update - s) / (args.max_update - args.warmup)))

    train = KmData(os.path.join(args.data, "train.tsv"), os.path.join(args.labels, "train.km"))
    valid = KmData(os.path.join(args.data, "valid.tsv"), os.path.join(args.labels, "valid.km"))
    tsamp = DistributedSampler(train, shuffle=True, drop_last=True)
    vsamp = DistributedSampler(valid, shuffle=False, drop_last=True)  # FSDP forward is collective
    tl = DataLoader(train, args.batch_size, sampler=tsamp, collate_fn=collate, num_workers=8, pin_memory=True,
                    drop_last=True)
    vl = DataLoader(valid, args.batch_size, sampler=vsamp, collate_fn=collate, num_workers=2)

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
    save_cfg = FullStateDictConfig(offload_to_cpu=True, rank0_only=True)

    step, epoch = 0, 0
    while step < args.max_update:
        tsamp.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for wav, lab in tl:
            wav, lab = wav.to(dev, non_blocking=True), lab.to(dev, non_blocking=True)
            mask = mask_for(wav.size(0), nframes(wav.size(1))).to(dev)
            logits, pen = model(wav, mask)
            ce, _, _ = masked_loss(logits, lab, mask)
            loss = ce + 10 * pen
            opt.zero_grad(set_to_none=True)
            loss.backward()
            model.clip_grad_norm_(1.0)
            opt.step()
            sched.step()
            step += 1
            if step % 100 == 0:
                r = loss.detach().float()
                dist.all_reduce(r, op=dist.ReduceOp.AVG)
                if rank == 0:
                    print(f"step {step} loss {r.item():.4f} lr {sched.get_last_lr()[0]:.2e} "
                          f"{(time.time() - t0) / 100:.2f}s/it", flush=True)
                    t0 = time.time()
            if step % args.save_every == 0 and rank == 0:
                with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, save_cfg):
                    cpu_state = model.state_dict()
                torch.save({"model": cpu_state, "step": step, "num_classes": args.num_classes},
                           os.path.join(args.out, f"hubert_xlarge_{step}.pt"))
            if step >= args.max_update:
                break
        epoch += 1

        model.eval()
        tot = torch.zeros(2, device=dev)
        with torch.no_grad():
            for wav, lab in vl:
                wav, lab = wav.to(dev), lab.to(dev)
                mask = mask_for(wav.size(0), nframes(wav.size(1))).to(dev)
                logits, _ = model(wav, mask)
                _, correct, n = masked_loss(logits, lab, mask)
                tot += torch.stack([correct, n.float()])
        dist.all_reduce(tot)
        if rank == 0:
            print(f"epoch {epoch} valid acc_m {(tot[0] / tot[1]).item():.4f}", flush=True)

    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
