"""Text-to-music LM (MusicGen-style, 1.5B) on EnCodec-32kHz tokens, DeepSpeed ZeRO-3.

Per clip: <root>/<split>/<id>.codes.npy  [4, T] int16 (50 Hz)
          <root>/<split>/<id>.t5.npy     [L, 1024] float16 (frozen T5-large encoder output of the caption)

    deepspeed --num_nodes 2 --num_gpus 8 --hostfile hostfile 19_musicgen_zero3.py \
        --root /shared/musiccaps_encodec --out /shared/runs/tt_music_1b5
"""
import argparse
import glob
import math
import os

import deepspeed
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

N_Q, CARD, SPECIAL = 4, 2048, 2048
T5_DIM, MAX_TEXT = 1024, 64


class TextMusicClips(Dataset):
    def __init__(self, root, split, frames, train=True):
        self.codes = sorted(glob.glob(os.path.join(root, split, "*.codes.npy")))
        self.frames, self.train = frames, train

    def __len__(self):
        return len(self.codes)

    def __getitem__(self, i):
        c = np.load(self.codes[i], mmap_mode="r")
        t5 = np.load(self.codes[i].replace(".codes.npy", ".t5.npy"))[:MAX_TEXT].astype(np.float32)
        T = c.shape[1]
        s = np.random.randint(0, max(1, T - self.frames + 1)) if self.train else 0
        seg = np.full((N_Q, self.frames), SPECIAL, dtype=np.int64)
        chunk = np.asarray(c[:, s:s + self.frames], dtype=np.int64)
        seg[:, :chunk.shape[1]] = chunk
        delayed = np.full((N_Q, self.frames + N_Q), SPECIAL, dtype=np.int64)
        for k in range(N_Q):
            delayed[k, k + 1:k + 1 + self.frames] = seg[k]
        text = np.zeros((MAX_TEXT, T5_DIM), dtype=np.float32)
        text[:len(t5)] = t5
        text_mask = np.zeros(MAX_TEXT, dtype=np.bool_)
        text_mask[:len(t5)] = True
        return torch.from_numpy(delayed), torch.from_numpy(text), torch.from_numpy(text_mask)


class Layer(nn.Module):
    def __init__(self, d, h):
        super().__init__()
        self.n1, self.n2, self.n3 = nn.LayerNorm(d), nn.LayerNorm(d), nn.LayerNorm(d)
        self.self_attn = nn.MultiheadAttention(d, h, batch_first=True, bias=False)
        self.cross_attn = nn.MultiheadAttention(d, h, batch_first=True, bias=False)
        self.ff = nn.Sequential(nn.Linear(d, 4 * d, bias=False), nn.GELU(), nn.Linear(4 * d, d, bias=False))

    def forward(self, x, causal, text, text_pad):
        h = self.n1(x)
        x = x + self.self_attn(h, h, h, attn_mask=causal, need_weights=False)[0]
        h = self.n2(x)
        x = x + self.cross_attn(h, text, text, key_padding_mask=text_pad, need_weights=False)[0]
        return x + self.ff(self.n3(x))


class TextToMusicLM(nn.Module):
    def __init__(self, d=1536, layers=24, heads=24, max_len=1600):
        super().__init__()
        self.text_proj = nn.Linear(T5_DIM, d)
        self.emb = nn.ModuleList(nn.Embedding(CARD + 1, d) for _ in range(N_Q))
        self.pos = nn.Embedding(max_len, d)
        self.layers = nn.ModuleList(Layer(d, heads) for _ in range(layers))
        self.out_norm = nn.LayerNorm(d)
        self.lm_heads = nn.ModuleList(nn.Linear(d, CARD, bias=False) for _ in range(N_Q))

    def forward(self, codes, text, text_mask):
        T = codes.size(-1)
        x = sum(self.emb[k](codes[:, k]) for k in range(N_Q)) + self.pos(torch.arange(T, device=codes.device))
        causal = torch.ones(T, T, dtype=torch.bool, device=codes.device).triu(1)
        text = self.text_proj(text)
        text_pad = ~text_mask
        for layer in self.layers:
            x = layer(x, causal, text, text_pad)
        x = self.out_norm(x)
        return torch.stack([head(x) for head in self.lm_heads], 1)


def lm_loss(engine, batch, device):
    codes, text, mask = (t.to(device, non_blocking=True) for t in batch)
    logits = engine(codes[:, :, :-1], text.to(torch.bfloat16), mask)
    tgt = codes[:, :, 1:]
    s = F.cross_entropy(logits.float().reshape(-1, CARD), tgt.reshape(-1), ignore_index=SPECIAL, reduction="sum")
    return s, (tgt != SPECIAL).sum()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--frames", type=int, default=1500)
    ap.add_argument("--micro_bs", type=int, default=4)
    ap.add_argument("--accum", type=int, default=2)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--epochs", type=int, default=10)
    ap.add_argument("--save_every", type=int, default=2000)
    ap.add_argument("--local_rank", type=int, default=-1)
    args = ap.parse_args()

    local_rank = int(os.environ.get("LOCAL_RANK", args.local_rank))
    torch.cuda.set_device(local_rank)
    deepspeed.init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    train_ds = TextMusicClips(args.root, "train", args.frames)
    val_ds = TextMusicClips(args.root, "valid", args.frames, train=False)
    train_sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    # ZeRO-3 forwards gather parameters collectively: every rank needs the same number of eval batches
    val_sampler = DistributedSampler(val_ds, shuffle=False, drop_last=True)
    train_dl = DataLoader(train_ds, args.micro_bs, sampler=train_sampler, num_workers=6, pin_memory=True,
                          drop_last=True)
    val_dl = DataLoader(val_ds, args.micro_bs, sampler=val_sampler, num_workers=2, drop_last=True)

    updates = args.epochs * len(train_dl) // args.accum
    ds_config = {
        "train_micro_batch_size_per_gpu": args.micro_bs,
        "gradient_accumulation_steps": args.accum,
        "gradient_clipping": 1.0,
        "bf16": {"enabled": True},
        "optimizer": {"type": "AdamW", "params": {"lr": args.lr, "betas": [0.9, 0.95], "weight_decay": 0.1}},
        "scheduler": {"type": "WarmupCosineLR",
                      "params": {"total_num_steps": updates, "warmup_num_steps": 2000, "warmup_min_ratio": 0.0,
                                 "cos_min_ratio": 0.05}},
        "zero_optimization": {
            "stage": 3, "overlap_comm": True, "contiguous_gradients": True,
            "stage3_prefetch_bucket_size": 5e7, "stage3_param_persistence_threshold": 1e5,
            "stage3_gather_16bit_weights_on_model_save": True,
        },
        "steps_per_print": 100,
    }

    with deepspeed.zero.Init(config_dict_or_path=ds_config):
        model = TextToMusicLM(max_len=args.frames + N_Q)
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config)

    tag, client = engine.load_checkpoint(args.out)
    start_epoch = client.get("epoch", 0) if tag is not None else 0

    for epoch in range(start_epoch, args.epochs):
        train_sampler.set_epoch(epoch)
        engine.train()
        for i, batch in enumerate(train_dl):
            s, n = lm_loss(engine, batch, device)
            engine.backward(s / n.clamp(min=1))
            engine.step()
            if (i + 1) % args.accum == 0 and engine.global_steps % args.save_every == 0:
                engine.save_checkpoint(args.out, tag=f"step{engine.global_steps}", client_state={"epoch": epoch})

        engine.eval()
        tot = torch.zeros(2, device=device, dtype=torch.float64)
        with torch.no_grad():
            for batch in val_dl:
                s, n = lm_loss(engine, batch, device)
                tot[0] += s
                tot[1] += n
        dist.all_reduce(tot)
        if rank == 0:
            print(f"epoch {epoch} steps {engine.global_steps} val ce {(tot[0] / tot[1]).item():.4f}", flush=True)
        engine.save_checkpoint(args.out, tag=f"epoch{epoch}", client_state={"epoch": epoch + 1})

    # plain weights for the inference / export code
    if rank == 0:
        os.makedirs(os.path.join(args.out, "export"), exist_ok=True)
        torch.save(engine.module.state_dict(), os.path.join(args.out, "export", "model.pt"))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
