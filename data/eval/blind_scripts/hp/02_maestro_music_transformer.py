"""Music Transformer style decoder on MAESTRO v3 performance events.

Event vocabulary (Oore et al.): 128 NOTE_ON, 128 NOTE_OFF, 100 TIME_SHIFT (10 ms),
32 VELOCITY, plus PAD / BOS / EOS.

Launch:
    torchrun --nproc_per_node=4 02_maestro_music_transformer.py --maestro /data/maestro-v3.0.0
"""
import argparse
import csv
import math
import os
import time
from datetime import timedelta

import numpy as np
import pretty_midi
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler

N_NOTE_ON, N_NOTE_OFF, N_SHIFT, N_VEL = 128, 128, 100, 32
OFF_NOTE_ON = 0
OFF_NOTE_OFF = OFF_NOTE_ON + N_NOTE_ON
OFF_SHIFT = OFF_NOTE_OFF + N_NOTE_OFF
OFF_VEL = OFF_SHIFT + N_SHIFT
PAD = OFF_VEL + N_VEL
BOS = PAD + 1
EOS = PAD + 2
VOCAB = EOS + 1


def midi_to_events(path):
    pm = pretty_midi.PrettyMIDI(path)
    notes = sorted((n for inst in pm.instruments if not inst.is_drum for n in inst.notes),
                   key=lambda n: n.start)
    timeline = []
    for n in notes:
        timeline.append((n.start, 1, n.pitch, n.velocity))
        timeline.append((n.end, 0, n.pitch, 0))
    timeline.sort(key=lambda e: (e[0], e[1]))
    events, t_prev, vel_prev = [], 0.0, -1
    for t, is_on, pitch, vel in timeline:
        steps = int(round((t - t_prev) * 100))
        while steps > 0:
            s = min(steps, N_SHIFT)
            events.append(OFF_SHIFT + s - 1)
            steps -= s
        t_prev = t
        if is_on:
            v = vel * N_VEL // 128
            if v != vel_prev:
                events.append(OFF_VEL + v)
                vel_prev = v
            events.append(OFF_NOTE_ON + pitch)
        else:
            events.append(OFF_NOTE_OFF + pitch)
    return np.asarray(events, dtype=np.int16)


def events_to_midi(events, path):
    pm = pretty_midi.PrettyMIDI()
    piano = pretty_midi.Instrument(program=0)
    t, vel, active = 0.0, 64, {}
    for e in events:
        if OFF_SHIFT <= e < OFF_VEL:
            t += (e - OFF_SHIFT + 1) / 100
        elif OFF_VEL <= e < PAD:
            vel = int((e - OFF_VEL) * 128 / N_VEL) + 2
        elif OFF_NOTE_ON <= e < OFF_NOTE_OFF:
            active[e - OFF_NOTE_ON] = (t, vel)
        elif OFF_NOTE_OFF <= e < OFF_SHIFT:
            pitch = e - OFF_NOTE_OFF
            if pitch in active:
                start, v = active.pop(pitch)
                if t > start:
                    piano.notes.append(pretty_midi.Note(v, pitch, start, t))
    pm.instruments.append(piano)
    pm.write(path)


def build_cache(maestro_root, cache_path):
    splits = {"train": [], "validation": [], "test": []}
    with open(os.path.join(maestro_root, "maestro-v3.0.0.csv")) as f:
        for row in csv.DictReader(f):
            splits[row["split"]].append(row["midi_filename"])
    data = {}
    for split, files in splits.items():
        data[split] = [midi_to_events(os.path.join(maestro_root, fn)) for fn in sorted(files)]
    tmp = cache_path + ".tmp"
    torch.save(data, tmp)
    os.replace(tmp, cache_path)


class EventChunks(Dataset):
    def __init__(self, pieces, seq_len, train=True):
        self.pieces = [p for p in pieces if len(p) > 32]
        self.seq_len = seq_len
        self.train = train

    def __len__(self):
        return len(self.pieces)

    def __getitem__(self, i):
        ev = self.pieces[i].astype(np.int64)
        n = self.seq_len + 1
        if len(ev) >= n:
            start = np.random.randint(0, len(ev) - n + 1) if self.train else 0
            seq = ev[start:start + n]
        else:
            seq = np.concatenate([[BOS], ev, [EOS]])
        if self.train:  # pitch transposition augmentation, +-3 semitones
            shift = np.random.randint(-3, 4)
            note = seq < OFF_SHIFT
            pitch = (seq[note] % 128) + shift
            ok = (pitch >= 0) & (pitch < 128)
            seq[note] = np.where(ok, seq[note] + shift, seq[note])
        out = np.full(n, PAD, dtype=np.int64)
        out[: len(seq)] = seq
        return torch.from_numpy(out)


class MusicTransformer(nn.Module):
    def __init__(self, vocab, d_model=512, n_layers=8, n_heads=8, max_len=2048, dropout=0.1):
        super().__init__()
        self.tok = nn.Embedding(vocab, d_model, padding_idx=PAD)
        self.pos = nn.Embedding(max_len, d_model)
        layer = nn.TransformerEncoderLayer(d_model, n_heads, 4 * d_model, dropout,
                                           activation="gelu", batch_first=True, norm_first=True)
        self.blocks = nn.TransformerEncoder(layer, n_layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab, bias=False)
        self.head.weight = self.tok.weight
        self.max_len = max_len

    def forward(self, x):
        T = x.size(1)
        pos = torch.arange(T, device=x.device)
        h = self.tok(x) + self.pos(pos)[None]
        mask = nn.Transformer.generate_square_subsequent_mask(T, device=x.device)
        h = self.blocks(h, mask=mask, is_causal=True)
        return self.head(self.norm(h))

    @torch.no_grad()
    def generate(self, prompt, max_new_tokens, temperature=1.0, top_k=64):
        x = prompt
        for _ in range(max_new_tokens):
            logits = self(x[:, -self.max_len:])[:, -1].float() / temperature
            kth = torch.topk(logits, top_k).values[:, -1:]
            logits[logits < kth] = -float("inf")
            nxt = torch.multinomial(F.softmax(logits, -1), 1)
            x = torch.cat([x, nxt], 1)
            if (nxt == EOS).all():
                break
        return x


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    tot = torch.zeros(2, device=device)
    for seq in loader:
        seq = seq.to(device, non_blocking=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(seq[:, :-1])
        tgt = seq[:, 1:]
        tot[0] += F.cross_entropy(logits.float().transpose(1, 2), tgt, ignore_index=PAD, reduction="sum")
        tot[1] += (tgt != PAD).sum()
    dist.all_reduce(tot, op=dist.ReduceOp.SUM)
    model.train()
    return (tot[0] / tot[1]).item()


def sample_across_ranks(model, val_pieces, args, device, rank, world_size, epoch):
    """Each rank continues its own prompts; rank 0 writes every rank's samples."""
    g = torch.Generator().manual_seed(1000 * epoch + rank)
    pieces = [p for p in val_pieces if len(p) >= args.prompt_len]
    idx = torch.randint(len(pieces), (args.samples_per_rank,), generator=g).tolist()
    prompt = torch.tensor(np.stack([pieces[i][:args.prompt_len].astype(np.int64) for i in idx]),
                          device=device)
    prompt = torch.cat([torch.full((prompt.size(0), 1), BOS, device=device), prompt], 1)
    out = model.generate(prompt, args.gen_len)

    # sequences end at different lengths on each rank: pad to the global max first
    length = torch.tensor([out.size(1)], device=device)
    dist.all_reduce(length, op=dist.ReduceOp.MAX)
    padded = F.pad(out, (0, int(length.item()) - out.size(1)), value=PAD)
    gathered = [torch.empty_like(padded) for _ in range(world_size)]
    dist.all_gather(gathered, padded)
    if rank == 0:
        sample_dir = os.path.join(args.out, "samples", f"epoch{epoch:03d}")
        os.makedirs(sample_dir, exist_ok=True)
        for r, block in enumerate(gathered):
            for j, seq in enumerate(block.cpu().tolist()):
                seq = [e for e in seq[1 + args.prompt_len:] if e < PAD]
                events_to_midi(seq, os.path.join(sample_dir, f"r{r}_{j}.mid"))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--maestro", required=True)
    ap.add_argument("--out", default="runs/maestro_mt")
    ap.add_argument("--seq_len", type=int, default=2048)
    ap.add_argument("--batch_size", type=int, default=4)
    ap.add_argument("--epochs", type=int, default=100)
    ap.add_argument("--lr", type=float, default=2e-4)
    ap.add_argument("--warmup", type=int, default=4000)
    ap.add_argument("--samples_per_rank", type=int, default=2)
    ap.add_argument("--prompt_len", type=int, default=256)
    ap.add_argument("--gen_len", type=int, default=1024)
    ap.add_argument("--resume", default="")
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    # rank 0 may spend a while building the event cache on the first run
    dist.init_process_group("nccl", timeout=timedelta(minutes=60))
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{local_rank}")
    torch.manual_seed(0)

    cache_path = os.path.join(args.maestro, "events_cache.pt")
    if rank == 0 and not os.path.exists(cache_path):
        build_cache(args.maestro, cache_path)
    dist.barrier()
    data = torch.load(cache_path, weights_only=False)

    train_ds = EventChunks(data["train"], args.seq_len, train=True)
    val_ds = EventChunks(data["validation"], args.seq_len, train=False)
    sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=sampler,
                              num_workers=6, pin_memory=True, drop_last=True)
    val_loader = DataLoader(Subset(val_ds, range(rank, len(val_ds), world_size)),
                            batch_size=args.batch_size, num_workers=2)

    model = MusicTransformer(VOCAB, max_len=args.seq_len).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.98), weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / args.warmup) * (args.warmup / max(s + 1, args.warmup)) ** 0.5)

    start_epoch = 0
    if args.resume:
        ckpt = torch.load(args.resume, map_location="cpu")
        model.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["opt"])
        sched.load_state_dict(ckpt["sched"])
        start_epoch = ckpt["epoch"] + 1

    ddp = DDP(model, device_ids=[local_rank])

    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)
        t0, n = time.time(), 0
        for seq in train_loader:
            seq = seq.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = ddp(seq[:, :-1])
                loss = F.cross_entropy(logits.float().transpose(1, 2), seq[:, 1:], ignore_index=PAD)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(ddp.parameters(), 1.0)
            opt.step()
            sched.step()
            n += 1
            if rank == 0 and n % 100 == 0:
                print(f"epoch {epoch} it {n}/{len(train_loader)} loss {loss.item():.3f} "
                      f"{(time.time() - t0) / n:.3f}s/it", flush=True)

        val_loss = evaluate(ddp.module, val_loader, device)
        if rank == 0:
            print(f"[epoch {epoch}] val nll {val_loss:.4f}", flush=True)
        if epoch % 5 == 4:
            ddp.module.eval()
            sample_across_ranks(ddp.module, val_ds.pieces, args, device, rank, world_size, epoch)
            ddp.module.train()
        if rank == 0:
            os.makedirs(args.out, exist_ok=True)
            torch.save({"model": ddp.module.state_dict(), "opt": opt.state_dict(),
                        "sched": sched.state_dict(), "epoch": epoch, "args": vars(args)},
                       os.path.join(args.out, "last.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
