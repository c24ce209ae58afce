# Drum pattern language model on the Groove MIDI Dataset (GMD).
#
# Each 16th-note step is one token: a 9-bit mask of which of the 9 canonical drum
# voices (kick, snare, closed hh, open hh, low/mid/high tom, crash, ride) are hit.
#
#   torchrun --standalone --nproc_per_node=4 05_groove_drum_transformer.py --gmd_root /data/groove
import argparse
import csv
import logging
import os
from dataclasses import dataclass, asdict

import numpy as np
import pretty_midi
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

log = logging.getLogger("drums")

# GM drum pitch -> 9 canonical voices (Magenta's reduced mapping)
DRUM_MAP = {36: 0, 35: 0, 38: 1, 40: 1, 37: 1, 42: 2, 22: 2, 44: 2, 46: 3, 26: 3,
            43: 4, 58: 4, 47: 5, 45: 5, 50: 6, 48: 6, 49: 7, 52: 7, 55: 7, 57: 7, 51: 8, 59: 8, 53: 8}
N_PATTERNS = 2 ** 9
BOS, PAD = N_PATTERNS, N_PATTERNS + 1
VOCAB = N_PATTERNS + 2


@dataclass
class Config:
    gmd_root: str = "/data/groove"
    out_dir: str = "runs/groove_lm"
    bars: int = 8
    d_model: int = 256
    n_layers: int = 6
    n_heads: int = 8
    dropout: float = 0.2
    batch_size: int = 64
    epochs: int = 200
    lr: float = 5e-4
    min_lr: float = 1e-5
    num_workers: int = 4
    seed: int = 0


def quantize(path, steps_per_bar=16):
    pm = pretty_midi.PrettyMIDI(path)
    tempo = pm.get_tempo_changes()[1]
    bpm = float(tempo[0]) if len(tempo) else 120.0
    step_sec = 60.0 / bpm / 4
    n_steps = int(np.ceil(pm.get_end_time() / step_sec)) + 1
    grid = np.zeros(n_steps, dtype=np.int64)
    for inst in pm.instruments:
        for note in inst.notes:
            v = DRUM_MAP.get(note.pitch)
            if v is not None:
                grid[int(round(note.start / step_sec))] |= 1 << v
    return grid


def load_split(root, split, bars):
    rows = list(csv.DictReader(open(os.path.join(root, "info.csv"))))
    out = []
    for r in rows:
        if r["split"] != split or r["beat_type"] != "beat" or r["time_signature"] != "4-4":
            continue
        grid = quantize(os.path.join(root, r["midi_filename"]))
        L = bars * 16
        for s in range(0, len(grid) - L + 1, 16 * 2):  # 2-bar hop
            out.append(grid[s:s + L])
    return np.stack(out) if out else np.zeros((0, bars * 16), dtype=np.int64)


class Patterns(Dataset):
    def __init__(self, arr):
        self.arr = torch.from_numpy(arr)

    def __len__(self):
        return len(self.arr)

    def __getitem__(self, i):
        return torch.cat([torch.tensor([BOS]), self.arr[i]])


class DrumLM(nn.Module):
    def __init__(self, cfg: Config):
        super().__init__()
        L = cfg.bars * 16 + 1
        self.tok = nn.Embedding(VOCAB, cfg.d_model)
        self.pos = nn.Embedding(L, cfg.d_model)
        self.beat = nn.Embedding(16, cfg.d_model)  # position inside the bar
        layer = nn.TransformerEncoderLayer(cfg.d_model, cfg.n_heads, 4 * cfg.d_model,
                                           cfg.dropout, batch_first=True, norm_first=True)
        self.tf = nn.TransformerEncoder(layer, cfg.n_layers, enable_nested_tensor=False)
        self.ln = nn.LayerNorm(cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, VOCAB)

    def forward(self, x):
        T = x.size(1)
        t = torch.arange(T, device=x.device)
        h = self.tok(x) + self.pos(t) + self.beat((t - 1).clamp(min=0) % 16)
        m = nn.Transformer.generate_square_subsequent_mask(T, device=x.device)
        return self.proj(self.ln(self.tf(h, mask=m, is_causal=True)))


def run_eval(model, loader, device):
    model.eval()
    loss_sum = torch.zeros((), device=device)
    correct = torch.zeros((), device=device)
    count = torch.zeros((), device=device)
    with torch.no_grad():
        for x in loader:
            x = x.to(device)
            logits = model(x[:, :-1])
            y = x[:, 1:]
            loss_sum += F.cross_entropy(logits.transpose(1, 2), y, reduction="sum")
            correct += (logits.argmax(-1) == y).sum()
            count += y.numel()
    for t in (loss_sum, correct, count):
        dist.all_reduce(t)
    model.train()
    return (loss_sum / count).item(), (correct / count).item()


def main():
    parser = argparse.ArgumentParser()
    for k, v in asdict(Config()).items():
        parser.add_argument(f"--{k}", type=type(v), default=v)
    cfg = Config(**vars(parser.parse_args()))

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(message)s")
    torch.manual_seed(cfg.seed)

    # GMD is small (~1150 files); every rank quantizes it in memory, nothing is written
    train = Patterns(load_split(cfg.gmd_root, "train", cfg.bars))
    valid = Patterns(load_split(cfg.gmd_root, "validation", cfg.bars))
    log.info("train windows %d, valid windows %d", len(train), len(valid))

    train_sampler = DistributedSampler(train, num_replicas=world, rank=rank, shuffle=True, seed=cfg.seed)
    train_loader = DataLoader(train, batch_size=cfg.batch_size, sampler=train_sampler,
                              num_workers=cfg.num_workers, pin_memory=True, drop_last=True)
    valid_idx = list(range(rank, len(valid), world))
    valid_loader = DataLoader(torch.utils.data.Subset(valid, valid_idx), batch_size=cfg.batch_size)

    model = DrumLM(cfg).to(device)
    ddp_model = DDP(model, device_ids=[local_rank])
    optimizer = torch.optim.AdamW(ddp_model.parameters(), lr=cfg.lr, weight_decay=0.05)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(
        optimizer, T_max=cfg.epochs * len(train_loader), eta_min=cfg.min_lr)

    os.makedirs(cfg.out_dir, exist_ok=True)
    best_acc = 0.0
    for epoch in range(cfg.epochs):
        ddp_model.train()
        running, n = 0.0, 0
        for x in train_loader:
            x = x.to(device, non_blocking=True)
            logits = ddp_model(x[:, :-1])
            loss = F.cross_entropy(logits.transpose(1, 2), x[:, 1:])
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(ddp_model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            running += loss.item()
            n += 1

        val_loss, val_acc = run_eval(model, valid_loader, device)
        log.info("epoch %d train %.4f valid %.4f acc %.3f lr %.2e", epoch, running / max(n, 1),
                 val_loss, val_acc, scheduler.get_last_lr()[0])
        if rank == 0:
            ckpt = {"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                    "epoch": epoch, "config": asdict(cfg)}
            torch.save(ckpt, os.path.join(cfg.out_dir, "last.pt"))
            if val_acc > best_acc:
                best_acc = val_acc
                torch.save(ckpt, os.path.join(cfg.out_dir, "best.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
