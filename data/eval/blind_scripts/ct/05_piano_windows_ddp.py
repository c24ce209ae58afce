"""REMI piano LM on the ADL Piano MIDI collection with x-transformers (relative position bias).

Every rank tokenises only its own share of the pieces (the full collection does not fit in host memory
eight times over), then cuts its pieces into fixed windows.

    torchrun --nproc_per_node=8 05_piano_windows_ddp.py --midi_dir data/adl-piano-midi --out runs/adl_remi
"""
import argparse
import logging
import math
import os
import random
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from miditok import REMI, TokenizerConfig
from symusic import Score
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.tensorboard import SummaryWriter
from x_transformers import AutoregressiveWrapper, Decoder, TransformerWrapper

logger = logging.getLogger(__name__)


def parse():
    ap = argparse.ArgumentParser()
    ap.add_argument("--midi_dir", type=Path, required=True)
    ap.add_argument("--out", type=Path, default=Path("runs/adl_remi"))
    ap.add_argument("--seq_len", type=int, default=1024)
    ap.add_argument("--dim", type=int, default=512)
    ap.add_argument("--depth", type=int, default=8)
    ap.add_argument("--batch_size", type=int, default=12)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--epochs", type=int, default=30)
    ap.add_argument("--val_frac", type=float, default=0.02)
    ap.add_argument("--max_shift", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    return ap.parse_args()


def make_tokenizer():
    return REMI(TokenizerConfig(pitch_range=(21, 109), num_velocities=24, use_tempos=True,
                                use_time_signatures=True, use_sustain_pedals=True,
                                special_tokens=["PAD", "BOS", "EOS"]))


def tokenize(tok, paths):
    pieces = []
    for p in paths:
        try:
            score = Score(p)
        except Exception as e:  # a few broken files in ADL
            logger.warning("skip %s: %s", p, e)
            continue
        if score.note_num() < 32:
            continue
        seq = tok.encode(score)
        seq = seq[0] if isinstance(seq, list) else seq
        pieces.append(np.array([tok["BOS_None"], *seq.ids, tok["EOS_None"]], dtype=np.int32))
    return pieces


class Windows(Dataset):
    def __init__(self, pieces, seq_len, pad_id, pitch_ids=None, max_shift=0):
        self.pieces, self.seq_len, self.pad_id = pieces, seq_len, pad_id
        self.max_shift = max_shift
        self.items = [(i, s) for i, p in enumerate(pieces) for s in range(0, max(1, len(p) - seq_len), seq_len)]
        if pitch_ids is not None:
            self.lo, self.hi = min(pitch_ids), max(pitch_ids)   # REMI pitch tokens are contiguous

    def __len__(self):
        return len(self.items)

    def __getitem__(self, k):
        i, s = self.items[k]
        w = self.pieces[i][s:s + self.seq_len + 1].astype(np.int64)
        if self.max_shift:
            m = (w >= self.lo) & (w <= self.hi)
            if m.any():
                d = random.randint(-self.max_shift, self.max_shift)
                if self.lo <= w[m].min() + d and w[m].max() + d <= self.hi:
                    w[m] += d
        out = np.full(self.seq_len + 1, self.pad_id, dtype=np.int64)
        out[:len(w)] = w
        return torch.from_numpy(out)


@torch.no_grad()
def evaluate(wrapper, loader, device, pad_id, pitch_lo, pitch_hi):
    net = wrapper.net
    net.eval()
    acc = torch.zeros(4, dtype=torch.float64, device=device)
    for seq in loader:
        seq = seq.to(device)
        x, y = seq[:, :-1], seq[:, 1:]
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = net(x).float()
        acc[0] += F.cross_entropy(logits.transpose(1, 2), y, ignore_index=pad_id, reduction="sum")
        acc[1] += (y != pad_id).sum()
        pm = (y >= pitch_lo) & (y <= pitch_hi)
        acc[2] += ((logits.argmax(-1) == y) & pm).sum()
        acc[3] += pm.sum()
    dist.all_reduce(acc)
    net.train()
    return math.exp(acc[0] / acc[1]), (acc[2] / acc[3]).item()


def main():
    args = parse()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{local_rank}")
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.ERROR)
    random.seed(args.seed + rank)
    torch.manual_seed(args.seed)

    tok = make_tokenizer()
    pad_id = tok["PAD_None"]
    pitch_ids = [i for t, i in tok.vocab.items() if t.startswith("Pitch_")]
    files = sorted(str(p) for p in args.midi_dir.rglob("*.mid*"))
    rng = random.Random(args.seed)
    rng.shuffle(files)
    n_val = int(len(files) * args.val_frac)
    val_files, train_files = files[:n_val], files[n_val:]

    # each rank tokenises its own slice of the corpus
    train_pieces = tokenize(tok, train_files[rank::world])
    val_pieces = tokenize(tok, val_files[rank::world])
    train_set = Windows(train_pieces, args.seq_len, pad_id, pitch_ids, args.max_shift)
    val_set = Windows(val_pieces, args.seq_len, pad_id)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, shuffle=True, num_workers=4,
                              pin_memory=True, drop_last=True)
    val_loader = DataLoader(val_set, batch_size=args.batch_size, num_workers=2)
    logger.info("rank 0: %d train pieces, %d windows", len(train_pieces), len(train_set))

    net = TransformerWrapper(
        num_tokens=len(tok.vocab), max_seq_len=args.seq_len,
        attn_layers=Decoder(dim=args.dim, depth=args.depth, heads=8, rel_pos_bias=True, attn_dropout=0.1,
                            ff_dropout=0.1))
    model = AutoregressiveWrapper(net, pad_value=pad_id, ignore_index=pad_id).to(device)
    model = DDP(model, device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr * world * args.batch_size / 96, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.epochs)

    writer = None
    if rank == 0:
        args.out.mkdir(parents=True, exist_ok=True)
        writer = SummaryWriter(args.out / "tb")

    best = float("inf")
    step = 0
    for epoch in range(args.epochs):
        model.train()
        for seq in train_loader:
            seq = seq.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model(seq)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
            opt.step()
            step += 1
            if writer is not None and step % 50 == 0:
                writer.add_scalar("loss/train", loss.item(), step)
        sched.step()

        ppl, pacc = evaluate(model.module, val_loader, device, pad_id, min(pitch_ids), max(pitch_ids))
        if rank == 0:
            logger.info("epoch %d val ppl %.3f pitch acc %.4f", epoch, ppl, pacc)
            writer.add_scalar("val/ppl", ppl, epoch)
            writer.add_scalar("val/pitch_acc", pacc, epoch)
            ckpt = {"net": model.module.net.state_dict(), "opt": opt.state_dict(), "epoch": epoch}
            torch.save(ckpt, args.out / "last.pt")
            if ppl < best:
                best = ppl
                torch.save(ckpt, args.out / "best.pt")
            start = torch.tensor([[tok["BOS_None"]]], device=device)
            model.module.eval()
            gen = model.module.generate(start, 1024, eos_token=tok["EOS_None"], temperature=0.9)
            model.module.train()
            tok.decode([gen[0].tolist()]).dump_midi(str(args.out / f"sample_{epoch:02d}.mid"))
        dist.barrier()

    if writer is not None:
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
