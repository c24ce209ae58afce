"""AR stage of a VALL-E style codec language model: phonemes + first EnCodec codebook, decoder-only.

Codes were extracted with `python tools/extract_codes.py` into <codes_dir>/<utt>.npy, shape [8, T].
"""
import argparse
import json
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
from torch.utils.tensorboard import SummaryWriter

NUM_AUDIO_TOKENS = 1024
AUDIO_BOS, AUDIO_EOS, AUDIO_PAD = 1024, 1025, 1026
TEXT_PAD = 0


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--manifest", required=True, help="jsonl with utt, phonemes (ids), codes path")
    p.add_argument("--valid_manifest", required=True)
    p.add_argument("--codes_dir", required=True)
    p.add_argument("--exp_dir", default="exp/valle_ar")
    p.add_argument("--n_text", type=int, default=512)
    p.add_argument("--d_model", type=int, default=1024)
    p.add_argument("--n_layers", type=int, default=12)
    p.add_argument("--n_heads", type=int, default=16)
    p.add_argument("--batch_size", type=int, default=16)
    p.add_argument("--max_audio_len", type=int, default=1500)
    p.add_argument("--lr", type=float, default=5e-4)
    p.add_argument("--warmup", type=int, default=5000)
    p.add_argument("--max_steps", type=int, default=300_000)
    p.add_argument("--log_every", type=int, default=100)
    p.add_argument("--valid_every", type=int, default=5000)
    p.add_argument("--init_from", default="")
    return p.parse_args()


class CodesDataset(Dataset):
    def __init__(self, manifest, codes_dir, max_audio_len):
        with open(manifest) as f:
            rows = [json.loads(l) for l in f]
        self.rows = [r for r in rows if r["n_frames"] <= max_audio_len]
        self.codes_dir = codes_dir

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        r = self.rows[i]
        codes = np.load(os.path.join(self.codes_dir, r["utt"] + ".npy"))[0]
        return torch.LongTensor(r["phonemes"]), torch.from_numpy(codes.astype(np.int64))


def collate(batch):
    texts, codes = zip(*batch)
    t_len = torch.LongTensor([len(t) for t in texts])
    a_len = torch.LongTensor([len(c) + 1 for c in codes])
    text = nn.utils.rnn.pad_sequence(texts, batch_first=True, padding_value=TEXT_PAD)
    a_in = nn.utils.rnn.pad_sequence([F.pad(c, (1, 0), value=AUDIO_BOS) for c in codes], batch_first=True,
                                     padding_value=AUDIO_PAD)
    a_out = nn.utils.rnn.pad_sequence([F.pad(c, (0, 1), value=AUDIO_EOS) for c in codes], batch_first=True,
                                      padding_value=-100)
    return text, t_len, a_in, a_out, a_len


class SinePositional(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.d = d
        self.alpha = nn.Parameter(torch.ones(1))

    def forward(self, x):
        pos = torch.arange(x.size(1), device=x.device, dtype=torch.float32)[:, None]
        div = torch.exp(torch.arange(0, self.d, 2, device=x.device, dtype=torch.float32) * (-math.log(10000.0) / self.d))
        pe = torch.zeros(x.size(1), self.d, device=x.device)
        pe[:, 0::2], pe[:, 1::2] = torch.sin(pos * div), torch.cos(pos * div)
        return x * math.sqrt(self.d) + self.alpha * pe.to(x.dtype)


class ValleAR(nn.Module):
    def __init__(self, n_text, d, n_layers, n_heads):
        super().__init__()
        self.text_emb = nn.Embedding(n_text, d, padding_idx=TEXT_PAD)
        self.audio_emb = nn.Embedding(NUM_AUDIO_TOKENS + 3, d)
        self.text_pos, self.audio_pos = SinePositional(d), SinePositional(d)
        layer = nn.TransformerEncoderLayer(d, n_heads, 4 * d, 0.1, batch_first=True, norm_first=True,
                                           activation="gelu")
        self.decoder = nn.TransformerEncoder(layer, n_layers, norm=nn.LayerNorm(d))
        self.head = nn.Linear(d, NUM_AUDIO_TOKENS + 1, bias=False)

    def forward(self, text, t_len, a_in, a_len):
        T, A = text.size(1), a_in.size(1)
        x = torch.cat([self.text_pos(self.text_emb(text)), self.audio_pos(self.audio_emb(a_in))], 1)
        # prefix LM: text attends to all text, audio attends to text and earlier audio
        mask = torch.zeros(T + A, T + A, dtype=torch.bool, device=x.device)
        mask[:T, T:] = True
        mask[T:, T:] = torch.triu(torch.ones(A, A, dtype=torch.bool, device=x.device), 1)
        pad = torch.cat([torch.arange(T, device=x.device)[None] >= t_len[:, None],
                         torch.arange(A, device=x.device)[None] >= a_len[:, None]], 1)
        h = self.decoder(x, mask=mask, src_key_padding_mask=pad)
        return self.head(h[:, T:])

    @torch.no_grad()
    def generate(self, text, prompt_codes, max_len=1000, top_k=50, temperature=1.0):
        a = torch.cat([torch.full((1, 1), AUDIO_BOS, device=text.device), prompt_codes], 1)
        t_len = torch.LongTensor([text.size(1)]).to(text.device)
        for _ in range(max_len):
            logits = self(text, t_len, a, torch.LongTensor([a.size(1)]).to(text.device))[:, -1] / temperature
            v, _ = torch.topk(logits, top_k)
            logits[logits < v[:, -1:]] = -float("inf")
            nxt = torch.multinomial(F.softmax(logits.float(), -1), 1)
            if nxt.item() == AUDIO_EOS:
                break
            a = torch.cat([a, nxt], 1)
        return a[:, 1 + prompt_codes.size(1):]


def main():
    args = parse()
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    torch.cuda.set_device(local_rank)
    if world_size > 1:
        dist.init_process_group("nccl")
    rank = dist.get_rank() if world_size > 1 else 0
    device = torch.device("cuda", local_rank)
    torch.manual_seed(42)

    train_ds = CodesDataset(args.manifest, args.codes_dir, args.max_audio_len)
    valid_ds = CodesDataset(args.valid_manifest, args.codes_dir, args.max_audio_len)
    sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True) if world_size > 1 else None
    loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=sampler, shuffle=sampler is None,
                        collate_fn=collate, num_workers=6, pin_memory=True, drop_last=True)

    model = ValleAR(args.n_text, args.d_model, args.n_layers, args.n_heads)
    if args.init_from:
        model.load_state_dict(torch.load(args.init_from, map_location="cpu")["model"])
    if world_size > 1:
        model = DDP(model, device_ids=[local_rank], output_device=local_rank)
    model = model.to(device)
    raw = model.module if world_size > 1 else model

    decay = [p for n, p in raw.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in raw.named_parameters() if p.dim() < 2]
    optim = torch.optim.AdamW([{"params": decay, "weight_decay": 0.01}, {"params": no_decay, "weight_decay": 0.0}],
                              lr=args.lr, betas=(0.9, 0.95))
    sched = torch.optim.lr_scheduler.LambdaLR(
        optim, lambda s: min(1.0, (s + 1) / args.warmup) * max(0.05, 0.5 * (1 + math.cos(math.pi * s / args.max_steps))))

    writer = None
    if rank == 0:
        os.makedirs(args.exp_dir, exist_ok=True)
        writer = SummaryWriter(args.exp_dir)

    step, epoch = 0, 0
    t0 = time.time()
    while step < args.max_steps:
        if sampler is not None:
            sampler.set_epoch(epoch)
        model.train()
        for text, t_len, a_in, a_out, a_len in loader:
            text, t_len = text.to(device, non_blocking=True), t_len.to(device, non_blocking=True)
            a_in, a_out, a_len = (x.to(device, non_blocking=True) for x in (a_in, a_out, a_len))
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = model(text, t_len, a_in, a_len)
            loss = F.cross_entropy(logits.float().transpose(1, 2), a_out, ignore_index=-100)
            optim.zero_grad(set_to_none=True)
            loss.backward()
            gn = nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optim.step()
            sched.step()
            step += 1

            if step % args.log_every == 0:
                with torch.no_grad():
                    valid = a_out != -100
                    acc = ((logits.argmax(-1) == a_out) & valid).sum().float() / valid.sum()
                stats = torch.stack([loss.detach(), acc])
                if world_size > 1:
                    dist.all_reduce(stats)
                    stats /= world_size
                if rank == 0:
                    el = (time.time() - t0) / args.log_every
                    print(f"step {step} loss {stats[0]:.4f} top1 {stats[1]:.3f} gn {gn:.2f} {el:.2f}s/it")
                    writer.add_scalar("train/loss", stats[0].item(), step)
                    writer.add_scalar("train/top1_acc", stats[1].item(), step)
                    writer.add_scalar("train/lr", sched.get_last_lr()[0], step)
                t0 = time.time()

            if step % args.valid_every == 0:
                if rank == 0:
                    raw.eval()
                    tot, n = 0.0, 0
                    vl = DataLoader(valid_ds, batch_size=args.batch_size, collate_fn=collate, num_workers=2)
                    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
                        for text, t_len, a_in, a_out, a_len in vl:
                            lg = raw(text.to(device), t_len.to(device), a_in.to(device), a_len.to(device))
                            tot += F.cross_entropy(lg.float().transpose(1, 2), a_out.to(device),
                                                   ignore_index=-100, reduction="sum").item()
                            n += (a_out != -100).sum().item()
                        ptext, pcodes = valid_ds[0]
                        gen = raw.generate(ptext[None].to(device), pcodes[None, :225].to(device))
                    writer.add_scalar("valid/loss", tot / max(n, 1), step)
                    writer.add_text("valid/generated_codes", " ".join(map(str, gen[0, :200].tolist())), step)
                    torch.save({"model": raw.state_dict(), "optimizer": optim.state_dict(),
                                "scheduler": sched.state_dict(), "step": step}, os.path.join(args.exp_dir, "last.pt"))
                    raw.train()
                if world_size > 1:
                    dist.barrier()
            if step >= args.max_steps:
                break
        epoch += 1

    if writer is not None:
        writer.close()
    if world_size > 1:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
