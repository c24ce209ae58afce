"""Decoder-only LM over flattened EnCodec tokens (24 kHz, 4 codebooks / 3 kbps).

Codes are pre-extracted to <codes_dir>/{train,valid}/*.npy with shape [4, T] (75 frames/s).
Tokens are interleaved frame by frame: [c0(t0), c1(t0), c2(t0), c3(t0), c0(t1), ...],
codebook k is offset by k * 1024 so that one embedding table covers all of them.

    torchrun --nnodes=1 --nproc_per_node=8 03_encodec_flat_lm.py --codes_dir /data/fma_encodec
"""
import argparse
import glob
import math
import os
import time

import numpy as np
import soundfile as sf
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler
from transformers import EncodecModel

N_Q = 4
CODEBOOK = 1024
BOS = N_Q * CODEBOOK
EOS = BOS + 1
PAD = BOS + 2
VOCAB = PAD + 1
FRAME_RATE = 75


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--codes_dir", required=True)
    p.add_argument("--out_dir", default="runs/encodec_lm")
    p.add_argument("--max_frames", type=int, default=750, help="10 s context")
    p.add_argument("--d_model", type=int, default=1024)
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--batch_size", type=int, default=6)
    p.add_argument("--lr", type=float, default=1.5e-4)
    p.add_argument("--max_steps", type=int, default=200_000)
    p.add_argument("--warmup", type=int, default=5000)
    p.add_argument("--eval_every", type=int, default=5000)
    p.add_argument("--prompt_sec", type=float, default=3.0)
    p.add_argument("--gen_sec", type=float, default=7.0)
    p.add_argument("--samples_per_rank", type=int, default=2)
    p.add_argument("--temperature", type=float, default=0.95)
    p.add_argument("--top_k", type=int, default=250)
    return p.parse_args()


def flatten_codes(codes):
    # codes: [N_Q, T] -> [T * N_Q]
    offs = (np.arange(N_Q) * CODEBOOK)[:, None]
    return (codes.astype(np.int64) + offs).T.reshape(-1)


def unflatten_tokens(tokens):
    T = len(tokens) // N_Q
    codes = np.asarray(tokens[: T * N_Q]).reshape(T, N_Q).T
    return codes - (np.arange(N_Q) * CODEBOOK)[:, None]


class CodeClips(Dataset):
    def __init__(self, files, max_frames, random_crop=True):
        self.files = files
        self.max_frames = max_frames
        self.random_crop = random_crop

    def __len__(self):
        return len(self.files)

    def __getitem__(self, i):
        codes = np.load(self.files[i], mmap_mode="r")[:N_Q]
        T = codes.shape[1]
        if T > self.max_frames:
            s = np.random.randint(0, T - self.max_frames + 1) if self.random_crop else 0
            codes = codes[:, s:s + self.max_frames]
            tail = []
        else:
            tail = [EOS]
        toks = np.concatenate([[BOS], flatten_codes(np.asarray(codes)), tail])
        out = np.full(self.max_frames * N_Q + 2, PAD, dtype=np.int64)
        out[: len(toks)] = toks
        return torch.from_numpy(out)


class CodecLM(nn.Module):
    def __init__(self, d_model, layers, heads, max_tokens):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, d_model)
        self.pos = nn.Parameter(torch.zeros(1, max_tokens, d_model))
        nn.init.normal_(self.pos, std=0.02)
        layer = nn.TransformerEncoderLayer(d_model, heads, 4 * d_model, dropout=0.1,
                                           batch_first=True, norm_first=True, activation="gelu")
        self.body = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.ln = nn.LayerNorm(d_model)
        self.out = nn.Linear(d_model, VOCAB, bias=False)

    def forward(self, x):
        T = x.size(1)
        h = self.emb(x) + self.pos[:, :T]
        causal = torch.triu(torch.full((T, T), float("-inf"), device=x.device), 1)
        return self.out(self.ln(self.body(h, mask=causal, is_causal=True)))


@torch.no_grad()
def sample(model, prompt, n_new, max_tokens, temperature, top_k):
    x = prompt
    done = torch.zeros(x.size(0), dtype=torch.bool, device=x.device)
    for _ in range(n_new):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(x[:, -max_tokens:])[:, -1].float()
        logits[:, BOS] = -float("inf")
        logits[:, PAD] = -float("inf")
        logits = logits / temperature
        v, _ = torch.topk(logits, top_k)
        logits[logits < v[:, -1:]] = -float("inf")
        nxt = torch.multinomial(logits.softmax(-1), 1).squeeze(1)
        nxt = torch.where(done, torch.full_like(nxt, PAD), nxt)
        done |= nxt == EOS
        x = torch.cat([x, nxt[:, None]], 1)
        if done.all():
            break
    return x


@torch.no_grad()
def validate(model, loader, device):
    model.eval()
    acc = torch.zeros(2, device=device, dtype=torch.float64)
    for x in loader:
        x = x.to(device, non_blocking=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(x[:, :-1])
        acc[0] += F.cross_entropy(logits.flatten(0, 1).float(), x[:, 1:].flatten(),
                                  ignore_index=PAD, reduction="sum")
        acc[1] += (x[:, 1:] != PAD).sum()
    dist.all_reduce(acc)
    model.train()
    return (acc[0] / acc[1]).item()


def generate_and_save(model, val_files, args, device, rank, world_size, step, codec):
    model.eval()
    rng = np.random.default_rng(step + 7919 * rank)
    prompt_frames = int(args.prompt_sec * FRAME_RATE)
    picks = rng.choice(len(val_files), size=args.samples_per_rank, replace=False)
    prompts = []
    for i in picks:
        codes = np.load(val_files[i])[:N_Q, :prompt_frames]
        prompts.append(np.concatenate([[BOS], flatten_codes(codes)]))
    prompt = torch.tensor(np.stack(prompts), device=device)
    out = sample(model, prompt, int(args.gen_sec * FRAME_RATE) * N_Q,
                 args.max_frames * N_Q + 1, args.temperature, args.top_k)
    model.train()

    gathered = [torch.zeros_like(out) for _ in range(world_size)]
    dist.all_gather(gathered, out)
    if rank != 0:
        return
    wav_dir = os.path.join(args.out_dir, "samples", f"step{step:07d}")
    os.makedirs(wav_dir, exist_ok=True)
    for r, batch in enumerate(gathered):
        for j, toks in enumerate(batch.tolist()):
            toks = toks[1:]
            if EOS in toks:
                toks = toks[: toks.index(EOS)]
            toks = [t for t in toks if t < BOS]
            codes = torch.tensor(unflatten_tokens(toks), device=device)[None, None]
            audio = codec.decode(codes, [None]).audio_values[0, 0].float().cpu().numpy()
            sf.write(os.path.join(wav_dir, f"rank{r}_{j}.wav"), audio, 24000)


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(42)

    train_files = sorted(glob.glob(os.path.join(args.codes_dir, "train", "*.npy")))
    val_files = sorted(glob.glob(os.path.join(args.codes_dir, "valid", "*.npy")))
    train_ds = CodeClips(train_files, args.max_frames)
    val_ds = Subset(CodeClips(val_files, args.max_frames, random_crop=False),
                    range(rank, len(val_files), world_size))
    sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    train_loader = DataLoader(train_ds, args.batch_size, sampler=sampler, num_workers=8,
                              pin_memory=True, drop_last=True, persistent_workers=True)
    val_loader = DataLoader(val_ds, args.batch_size, num_workers=4)

    max_tokens = args.max_frames * N_Q + 1
    model = CodecLM(args.d_model, args.layers, args.heads, max_tokens).to(device)
    model = DDP(model, device_ids=[local_rank])
    codec = EncodecModel.from_pretrained("facebook/encodec_24khz").to(device).eval() if rank == 0 else None

    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / args.warmup)
                                              * 0.5 * (1 + math.cos(math.pi * min(s / args.max_steps, 1.0))))

    os.makedirs(args.out_dir, exist_ok=True)
    step, epoch = 0, 0
    t0 = time.time()
    while step < args.max_steps:
        sampler.set_epoch(epoch)
        for x in train_loader:
            x = x.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = model(x[:, :-1])
            loss = F.cross_entropy(logits.flatten(0, 1).float(), x[:, 1:].flatten(), ignore_index=PAD)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            gn = nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            step += 1

            if rank == 0 and step % 100 == 0:
                print(f"step {step} loss {loss.item():.3f} gnorm {gn:.2f} "
                      f"{(time.time() - t0) / 100:.2f}s/step", flush=True)
                t0 = time.time()

            if step % args.eval_every == 0:
                val_loss = validate(model.module, val_loader, device)
                generate_and_save(model.module, val_files, args, device, rank, world_size, step, codec)
                if rank == 0:
                    print(f"step {step} val_loss {val_loss:.4f}", flush=True)
                    torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(),
                                "step": step}, os.path.join(args.out_dir, "ckpt.pt"))
                dist.barrier()
            if step >= args.max_steps:
                break
        epoch += 1

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
