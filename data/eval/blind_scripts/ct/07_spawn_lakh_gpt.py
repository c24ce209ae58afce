"""BPE-REMI GPT on Lakh MIDI (clean subset), one process per GPU started with torch.multiprocessing.spawn.

    python 07_spawn_lakh_gpt.py --midi_dir data/clean_midi --out runs/lakh_bpe --gpus 4
"""
import argparse
import math
import os
import pickle
import random
import socket
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
from miditok import REMI, TokenizerConfig
from symusic import Score
from torch.nn.modules.utils import consume_prefix_in_state_dict_if_present
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler


def free_port():
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def prepare(args):
    """Runs once in the parent: train BPE, tokenise, split. Workers only read the result."""
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tok_path, data_path = out / "tokenizer.json", out / "data.pkl"
    files = sorted(Path(args.midi_dir).rglob("*.mid"))
    if not tok_path.exists():
        tok = REMI(TokenizerConfig(use_programs=True, one_token_stream_for_programs=True, use_tempos=True,
                                   num_velocities=16, special_tokens=["PAD", "BOS", "EOS"]))
        tok.train(vocab_size=args.vocab_size, files_paths=files[: args.bpe_files])
        tok.save(tok_path)
    if not data_path.exists():
        tok = REMI(params=tok_path)
        pieces = []
        for f in files:
            try:
                ids = tok.encode(Score(f)).ids
            except Exception:
                continue
            if len(ids) > 64:
                pieces.append((f.parent.name, np.asarray(ids, dtype=np.int32)))
        artists = sorted({a for a, _ in pieces})
        random.Random(0).shuffle(artists)
        val_artists = set(artists[: max(1, len(artists) // 20)])     # hold out whole artists
        data = {"train": [p for a, p in pieces if a not in val_artists],
                "val": [p for a, p in pieces if a in val_artists]}
        with open(data_path, "wb") as fh:
            pickle.dump(data, fh)
    return tok_path, data_path


class Chunks(Dataset):
    def __init__(self, pieces, seq_len, bos, eos):
        self.seq_len = seq_len
        self.pieces = [np.concatenate([[bos], p, [eos]]) for p in pieces]
        self.idx = [(i, s) for i, p in enumerate(self.pieces) for s in range(0, max(1, len(p) - seq_len), seq_len)]

    def __len__(self):
        return len(self.idx)

    def __getitem__(self, k):
        i, s = self.idx[k]
        w = self.pieces[i][s:s + self.seq_len + 1]
        out = np.zeros(self.seq_len + 1, dtype=np.int64)
        out[:len(w)] = w
        return torch.from_numpy(out)


class GPT(nn.Module):
    def __init__(self, vocab, d=768, n_layer=12, n_head=12, max_len=1024, dropout=0.1):
        super().__init__()
        self.max_len = max_len
        self.wte, self.wpe = nn.Embedding(vocab, d), nn.Embedding(max_len, d)
        layer = nn.TransformerEncoderLayer(d, n_head, 4 * d, dropout, "gelu", batch_first=True, norm_first=True)
        self.h = nn.TransformerEncoder(layer, n_layer, enable_nested_tensor=False)
        self.ln_f = nn.LayerNorm(d)
        self.lm_head = nn.Linear(d, vocab, bias=False)

    def forward(self, idx):
        t = idx.size(1)
        x = self.wte(idx) + self.wpe(torch.arange(t, device=idx.device))
        mask = nn.Transformer.generate_square_subsequent_mask(t, device=idx.device)
        return self.lm_head(self.ln_f(self.h(x, mask=mask, is_causal=True)))

    @torch.no_grad()
    def sample(self, idx, n, temperature=1.0, top_k=50, eos=None):
        for _ in range(n):
            logits = self(idx[:, -self.max_len:])[:, -1] / temperature
            kth = logits.topk(top_k).values[:, -1:]
            logits = logits.masked_fill(logits < kth, float("-inf"))
            idx = torch.cat([idx, torch.multinomial(logits.softmax(-1), 1)], 1)
            if eos is not None and idx[0, -1].item() == eos:
                break
        return idx


def worker(rank, world_size, args, port, tok_path, data_path):
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    device = torch.device("cuda", rank)
    torch.manual_seed(args.seed)

    tok = REMI(params=tok_path)
    with open(data_path, "rb") as fh:
        data = pickle.load(fh)
    pad, bos, eos = tok["PAD_None"], tok["BOS_None"], tok["EOS_None"]
    train_set = Chunks(data["train"], args.seq_len, bos, eos)
    val_set = Chunks(data["val"], args.seq_len, bos, eos)
    sampler = DistributedSampler(train_set, num_replicas=world_size, rank=rank, shuffle=True, seed=args.seed)
    train_dl = DataLoader(train_set, args.batch_size, sampler=sampler, num_workers=4, pin_memory=True,
                          drop_last=True, persistent_workers=True)
    val_dl = DataLoader(Subset(val_set, range(rank, len(val_set), world_size)), args.batch_size, num_workers=2)

    model = DDP(GPT(len(tok), max_len=args.seq_len).to(device), device_ids=[rank])
    global_bs = args.batch_size * world_size
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr * global_bs / 256, betas=(0.9, 0.95), weight_decay=0.1)
    total = args.epochs * len(train_dl)
    warm = max(1, int(0.03 * total))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min((s + 1) / warm, 0.5 * (1 + math.cos(math.pi * s / total))))
    scaler = torch.cuda.amp.GradScaler()

    best = float("inf")
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        for i, seq in enumerate(train_dl):
            seq = seq.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.float16):
                logits = model(seq[:, :-1])
            loss = F.cross_entropy(logits.float().transpose(1, 2), seq[:, 1:], ignore_index=pad)
            opt.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(opt)
            scaler.update()
            sched.step()
            if rank == 0 and i % 100 == 0:
                print(f"epoch {epoch} it {i}/{len(train_dl)} loss {loss.item():.4f}", flush=True)

        # validation on the raw module: shards are uneven, and eval needs no gradient sync
        net = model.module.eval()
        tot = torch.zeros(2, device=device, dtype=torch.float64)
        with torch.no_grad():
            for seq in val_dl:
                seq = seq.to(device)
                with torch.autocast("cuda", dtype=torch.float16):
                    logits = net(seq[:, :-1])
                tot[0] += F.cross_entropy(logits.float().transpose(1, 2), seq[:, 1:], ignore_index=pad, reduction="sum")
                tot[1] += (seq[:, 1:] != pad).sum()
        dist.all_reduce(tot)
        val_ppl = math.exp(tot[0] / tot[1])
        net.train()

        if rank == 0:
            print(f"epoch {epoch} val ppl {val_ppl:.3f}", flush=True)
            torch.save(model.state_dict(), os.path.join(args.out, "last.pt"))
            if val_ppl < best:
                best = val_ppl
                torch.save(model.state_dict(), os.path.join(args.out, "best.pt"))
        dist.barrier()

    dist.destroy_process_group()

    if rank == 0:
        # rebuild a plain model from the best checkpoint (saved from the DDP wrapper) for demo samples
        sd = torch.load(os.path.join(args.out, "best.pt"), map_location=device)
        consume_prefix_in_state_dict_if_present(sd, "module.")
        demo = GPT(len(tok), max_len=args.seq_len).to(device)
        demo.load_state_dict(sd)
        demo.eval()
        for k in range(4):
            out = demo.sample(torch.tensor([[bos]], device=device), 2048, temperature=1.0, eos=eos)
            tok.decode(out[0, 1:].tolist()).dump_midi(os.path.join(args.out, f"final_sample_{k}.mid"))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--midi_dir", required=True)
    ap.add_argument("--out", default="runs/lakh_bpe")
    ap.add_argument("--gpus", type=int, default=torch.cuda.device_count())
    ap.add_argument("--vocab_size", type=int, default=20000)
    ap.add_argument("--bpe_files", type=int, default=5000)
    ap.add_argument("--seq_len", type=int, default=1024)
    ap.add_argument("--batch_size", type=int, default=16)
    ap.add_argument("--lr", type=float, default=6e-4)
    ap.add_argument("--epochs", type=int, default=20)
    ap.add_argument("--seed", type=int, default=42)
    args = ap.parse_args()

    tok_path, data_path = prepare(args)
    port = free_port()
    mp.spawn(worker, args=(args.gpus, args, port, str(tok_path), str(data_path)), nprocs=args.gpus, join=True)


if __name__ == "__main__":
    main()
