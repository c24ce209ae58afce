"""Large visual speech recognition model (~1B params) trained with FSDP on LRS3 + VoxCeleb2-en.

Video is embedded with 3D tubelets (2 frames x 16 x 16 pixels) instead of a ResNet frontend, so the
whole network is transformer blocks and shards cleanly. CTC + attention decoder.

    srun --nodes=4 --ntasks-per-node=1 torchrun --nnodes=4 --nproc_per_node=8 \
        --rdzv_backend=c10d --rdzv_endpoint=$HEAD_NODE:29500 11_vsr_fsdp_large.py --cfg configs/vsr_1b.yaml
"""
import argparse
import functools
import math
import os
import time

import numpy as np
import sentencepiece as spm
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import yaml
from torch.distributed.fsdp import FullStateDictConfig, MixedPrecision, ShardingStrategy, StateDictType
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


class Block(nn.Module):
    def __init__(self, d, heads, cross=False):
        super().__init__()
        self.ln1 = nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, heads, batch_first=True)
        self.cross = cross
        if cross:
            self.ln_x = nn.LayerNorm(d)
            self.xattn = nn.MultiheadAttention(d, heads, batch_first=True)
        self.ln2 = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x, pad=None, causal=None, mem=None, mem_pad=None):
        h = self.ln1(x)
        x = x + self.attn(h, h, h, key_padding_mask=pad, attn_mask=causal, need_weights=False)[0]
        if self.cross:
            h = self.ln_x(x)
            x = x + self.xattn(h, mem, mem, key_padding_mask=mem_pad, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class TubeletVSR(nn.Module):
    def __init__(self, vocab, d=1536, heads=16, enc_layers=24, dec_layers=8, tube_t=2, patch=16, img=88):
        super().__init__()
        self.tube_t = tube_t
        self.embed = nn.Conv3d(1, d, (tube_t, patch, patch), (tube_t, patch, patch))
        n_patches = (img // patch) ** 2
        self.space_pos = nn.Parameter(torch.zeros(1, 1, n_patches, d))
        self.time_pos = nn.Parameter(torch.zeros(1, 1024, 1, d))
        self.spatial_pool = nn.Linear(d, 1)
        self.enc = nn.ModuleList([Block(d, heads) for _ in range(enc_layers)])
        self.enc_ln = nn.LayerNorm(d)
        self.ctc = nn.Linear(d, vocab)
        self.tok = nn.Embedding(vocab, d)
        self.dec_pos = nn.Parameter(torch.zeros(1, 512, d))
        self.dec = nn.ModuleList([Block(d, heads, cross=True) for _ in range(dec_layers)])
        self.dec_ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab)
        self.eos = vocab - 1
        for p in (self.space_pos, self.time_pos, self.dec_pos):
            nn.init.trunc_normal_(p, std=0.02)

    def forward(self, v, lens, ys=None, ylens=None, ctc_weight=0.1):
        x = self.embed(v.unsqueeze(1))                          # B, d, T/2, 5, 5
        x = x.flatten(3).permute(0, 2, 3, 1)                     # B, T', P, d
        x = x + self.space_pos + self.time_pos[:, : x.size(1)]
        w = self.spatial_pool(x).softmax(2)
        x = (w * x).sum(2)                                       # B, T', d
        lens = torch.div(lens + self.tube_t - 1, self.tube_t, rounding_mode="floor")
        pad = torch.arange(x.size(1), device=x.device)[None] >= lens[:, None]
        for blk in self.enc:
            x = blk(x, pad=pad)
        x = self.enc_ln(x)
        if ys is None:
            return self.ctc(x).float().log_softmax(-1), lens
        l_ctc = F.ctc_loss(self.ctc(x).float().log_softmax(-1).transpose(0, 1), ys, lens, ylens, zero_infinity=True)

        ys_in = F.pad(ys, (1, 0), value=self.eos)
        tgt = F.pad(ys, (0, 1), value=0)
        tgt[torch.arange(len(ys)), ylens] = self.eos
        tgt = tgt.masked_fill(torch.arange(tgt.size(1), device=ys.device)[None] > ylens[:, None], -100)
        L = ys_in.size(1)
        causal = torch.triu(torch.ones(L, L, dtype=torch.bool, device=ys.device), 1)
        h = self.tok(ys_in) + self.dec_pos[:, :L]
        for blk in self.dec:
            h = blk(h, causal=causal, mem=x, mem_pad=pad)
        l_att = F.cross_entropy(self.head(self.dec_ln(h)).float().flatten(0, 1), tgt.flatten(), ignore_index=-100,
                                label_smoothing=0.1)
        return ctc_weight * l_ctc + (1 - ctc_weight) * l_att, l_ctc.detach(), l_att.detach()


class LipClips(Dataset):
    def __init__(self, manifest, sp, max_frames, train=True):
        self.rows = []
        for line in open(manifest):
            path, n, text = line.rstrip("\n").split("\t")
            if int(n) <= max_frames:
                self.rows.append((path, text))
        self.sp, self.train = sp, train

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        path, text = self.rows[i]
        v = np.load(path)
        y0, x0 = np.random.randint(0, 9, 2) if self.train else (4, 4)
        v = (v[:, y0:y0 + 88, x0:x0 + 88].astype(np.float32) / 255.0 - 0.421) / 0.165
        return torch.from_numpy(v), torch.tensor(self.sp.encode(text)) + 1


def edit_distance(r, h):
    d = list(range(len(h) + 1))
    for i in range(1, len(r) + 1):
        prev, d[0] = d[0], i
        for j in range(1, len(h) + 1):
            prev, d[j] = d[j], min(d[j] + 1, d[j - 1] + 1, prev + (r[i - 1] != h[j - 1]))
    return d[-1]


@torch.no_grad()
def evaluate(model, ds, sp, rank, world, bs=8):
    """Greedy CTC WER. Every rank runs the same number of forwards (FSDP all-gathers in each one);
    the padding indices at the end are decoded but not counted."""
    model.eval()
    n = len(ds)
    padded = math.ceil(n / world) * world
    idx = list(range(rank, padded, world))
    counts = torch.zeros(2, device="cuda", dtype=torch.float64)
    for s in range(0, len(idx), bs):
        chunk = idx[s:s + bs]
        v, lens, _, _ = collate([ds[i % n] for i in chunk])
        logp, out_lens = model(v.cuda(), lens.cuda())
        for i, row, m in zip(chunk, logp.argmax(-1).tolist(), out_lens.tolist()):
            if i >= n:
                continue
            toks, prev = [], None
            for t in row[:m]:
                if t != prev and t not in (0, len(sp) + 1):
                    toks.append(t - 1)
                prev = t
            ref = ds.rows[i][1].split()
            counts[0] += edit_distance(ref, sp.decode(toks).split())
            counts[1] += len(ref)
    dist.all_reduce(counts)
    model.train()
    return (counts[0] / counts[1]).item()


def collate(b):
    v, y = zip(*b)
    T = max(x.size(0) for x in v)
    T += T % 2
    vv = torch.zeros(len(v), T, 88, 88)
    for i, x in enumerate(v):
        vv[i, : x.size(0)] = x
    return vv, torch.tensor([x.size(0) for x in v]), nn.utils.rnn.pad_sequence(y, True), torch.tensor([len(x) for x in y])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cfg", required=True)
    cfg = yaml.safe_load(open(ap.parse_args().cfg))

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(cfg.get("seed", 0))

    sp = spm.SentencePieceProcessor(model_file=cfg["spm"])
    vocab = sp.get_piece_size() + 2
    ds = LipClips(cfg["train_manifest"], sp, cfg.get("max_frames", 400))
    valid_ds = LipClips(cfg["valid_manifest"], sp, 10 ** 9, train=False)
    sampler = DistributedSampler(ds, shuffle=True, drop_last=True)
    dl = DataLoader(ds, cfg["batch_size"], sampler=sampler, num_workers=10, collate_fn=collate, pin_memory=True,
                    drop_last=True, persistent_workers=True)

    model = TubeletVSR(vocab, **cfg.get("model", {}))
    if rank == 0:
        print(f"params: {sum(p.numel() for p in model.parameters()) / 1e9:.2f}B", flush=True)
    model = FSDP(
        model,
        auto_wrap_policy=functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={Block}),
        mixed_precision=MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
                                       buffer_dtype=torch.float32),
        sharding_strategy=ShardingStrategy.FULL_SHARD,
        device_id=torch.cuda.current_device(),
        use_orig_params=True,
        limit_all_gathers=True,
    )
    opt = torch.optim.AdamW(model.parameters(), lr=cfg["lr"], betas=(0.9, 0.95), weight_decay=0.1)
    total = cfg["epochs"] * len(dl)
    warm = cfg.get("warmup_steps", 4000)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warm) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, s / total)))))

    out_dir = cfg["out_dir"]
    if rank == 0:
        os.makedirs(out_dir, exist_ok=True)

    step = 0
    for epoch in range(cfg["epochs"]):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for v, lens, ys, ylens in dl:
            v, lens, ys, ylens = (x.cuda(non_blocking=True) for x in (v, lens, ys, ylens))
            loss, l_ctc, l_att = model(v, lens, ys, ylens, cfg.get("ctc_weight", 0.1))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            model.clip_grad_norm_(1.0)
            opt.step()
            sched.step()
            step += 1
            if step % 50 == 0:
                stats = torch.stack([loss.detach(), l_ctc, l_att]).float()
                dist.all_reduce(stats, op=dist.ReduceOp.AVG)
                if rank == 0:
                    print(f"ep {epoch} step {step} loss {stats[0]:.3f} ctc {stats[1]:.3f} att {stats[2]:.3f} "
                          f"lr {sched.get_last_lr()[0]:.2e} {50 / (time.time() - t0):.2f} it/s", flush=True)
                    t0 = time.time()

            if step % cfg.get("save_every", 5000) == 0:
                if rank == 0:
                    save_cfg = FullStateDictConfig(offload_to_cpu=True, rank0_only=True)
                    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, save_cfg):
                        state = model.state_dict()
                    torch.save({"model": state, "step": step, "epoch": epoch, "cfg": cfg},
                               os.path.join(out_dir, f"step{step:07d}.pt"))
                    print(f"saved checkpoint at step {step}", flush=True)
                dist.barrier()

        wer = evaluate(model, valid_ds, sp, rank, world)
        if rank == 0:
            print(f"epoch {epoch} valid WER {100 * wer:.2f}%", flush=True)

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
